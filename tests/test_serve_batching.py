"""The judge server's worker (batching modes, batch invariance, cancelled requests) and its
request preparation (the per-image feature cache)."""

from __future__ import annotations

import json

import pytest
import torch

from paco.core.templates import judge_instruction
from paco.judge.model import Judge
from paco.serving.server.batching import BatchingJudge
from paco.serving.server.limits import ServerLimits
from paco.serving.server.preparation import RequestPreparer
from paco.serving.server.protocol import IMAGE_KEY

from judge_server_helpers import NAME, images, request_body


@pytest.fixture(scope="module")
def judge(tiny_model_dirs) -> Judge:
    return Judge.from_pretrained(tiny_model_dirs["judge_base"])


def _batch_rows(judge, triples: list, batching: str, top_k: int) -> tuple[list, list[int]]:
    """Submit ``triples`` at once to a fresh batcher that collects exactly that many, return
    the results in order and the batch sizes of the forward passes."""
    sizes: list[int] = []

    class Recording:  # the judge, recording how many rows each forward pass had
        processor = judge.processor
        device = judge.device
        encode = staticmethod(judge.encode)

        def logits(self, inputs):
            sizes.append(int(inputs["input_ids"].shape[0]))
            return judge.logits(inputs)

    batcher = BatchingJudge(Recording(), max_batch_size=len(triples), max_wait_ms=20_000, batching=batching)
    try:
        futures = [batcher.submit(t, top_k) for t in triples]
        return [f.result(timeout=120) for f in futures], sizes
    finally:
        batcher.close()


@pytest.mark.parametrize("batching", ["auto", "single"])
def test_logprobs_do_not_depend_on_the_batch(judge, batching):
    """The same request, alone and inside batches of 4, 8 and 16 of other contents, prompt lengths
    and image sizes, gets bit-identical log-probs of every vocabulary token (the old server
    left-padded mixed batches into one pass: rows differed by ~3e-6)."""
    ims = images(4, seed=1, size=(100, 128)) + images(2, seed=2, size=(128, 70)) + images(2, seed=3)
    target = (ims[0], ims[1], judge_instruction("a cat"))
    same_shape = [(ims[2], ims[3], target[2]), (ims[1], ims[0], target[2]), (ims[3], ims[2], target[2])]
    texts = [judge_instruction(t) for t in (None, "a red fox in the snow", "robots")]
    mixed = [(ims[4 + i % 4], ims[(i * 3) % 8], texts[i % 3]) for i in range(12)]
    assert len({judge.encode([t])["input_ids"].shape[1] for t in [target] + mixed}) >= 3
    n_vocab = len(judge.processor.tokenizer)
    (alone,), sizes = _batch_rows(judge, [target], batching, n_vocab)
    assert sizes == [1] and len(alone[2]) == n_vocab
    for others, pos in ((same_shape, 0), (same_shape[:1] + mixed[:6], 7), (same_shape + mixed, 9)):
        triples = list(others)
        triples.insert(pos, target)
        results, sizes = _batch_rows(judge, triples, batching, n_vocab)
        assert results[pos] == alone  # (token id, logprob, [(id, logprob), ...]) exactly
        assert sizes == [1] * len(triples)  # auto is single: a pass per request, on any device


def test_an_images_vision_features_depend_on_its_own_pixels_only(judge):
    """GRPO's 128 px grids give 64 px panels: 8 merged vision tokens per image, where CPU GEMM
    kernels for few rows round differently from many (the vision tower batched changed the
    logits by ~3e-6). The tower runs per image, so an image's features are bit-identical alone,
    beside another image of its pair, and in a batch of 32 requests; computed with and without
    the tower cache alike."""
    ims = images(34, seed=5, size=(64, 64))
    encodings = [judge.encode([(ims[i], ims[i + 1], judge_instruction(None))]) for i in range(33)]
    uncached = Judge(judge.model, judge.processor, tower_cache_bytes=0)

    def features(j, enc):
        return j.image_features(enc["pixel_values"], enc["image_grid_thw"]).pooler_output

    alone = [features(uncached, judge.encode([(im, im, judge_instruction(None))]))[0] for im in ims[:9]]
    for n in (1, 2, 3, 8, 32):
        batch = {k: torch.cat([e[k] for e in encodings[:n]]) for k in encodings[0]}
        for j in (uncached, judge):
            together = features(j, batch)
            assert len(together) == 2 * n
            for i in range(min(n, 8)):
                assert torch.equal(together[2 * i], alone[i]) and torch.equal(together[2 * i + 1], alone[i + 1]), (n, i)


def test_the_tower_cache_computes_a_recurring_image_once_and_stays_in_its_bound(judge):
    """A 2x2 grid's 6 panel pairs compute the tower for its 4 panels only; the logits equal an
    uncached judge's bit for bit; the cache's bytes stay within ``tower_cache_bytes`` (least
    recently used images dropped)."""
    panels = images(4, seed=21, size=(64, 64))
    text = judge_instruction(None)
    pairs = [(panels[a], panels[b], text) for a in range(4) for b in range(a + 1, 4)]
    cached = Judge(judge.model, judge.processor)
    uncached = Judge(judge.model, judge.processor, tower_cache_bytes=0)
    calls: list[int] = []
    inner = judge.model.get_image_features

    def counting(pixel_values, grid_thw, **kw):
        calls.append(int(grid_thw.shape[0]))
        return inner(pixel_values, grid_thw, **kw)

    judge.model.get_image_features = counting
    try:
        got = [cached.logits(cached.encode([p])) for p in pairs]
        assert calls == [1] * 4 and (cached.tower_cache.hits, cached.tower_cache.misses) == (8, 4)
        calls.clear()
        want = [uncached.logits(uncached.encode([p])) for p in pairs]
        assert calls == [1] * 12
    finally:
        del judge.model.get_image_features  # the class's method again
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    one = cached.tower_cache.nbytes // 4  # every panel's features have the same size
    small = Judge(judge.model, judge.processor, tower_cache_bytes=2 * one)
    for p in pairs:
        small.logits(small.encode([p]))
        assert small.tower_cache.nbytes <= 2 * one
    assert len(small.tower_cache) == 2
    with pytest.raises(ValueError, match="max_bytes"):
        Judge(judge.model, judge.processor, tower_cache_bytes=-1)


def test_requests_with_different_image_grids_are_scored_alone(judge):
    """GRPO's panels of one grid cut at separator bands differ by a pixel (32x32 and 31x32 px,
    vision grids 4x4 and 6x4 patches). Batched, such a request's log-probs changed by ~1e-7
    (the vision tower), which made GRPO runs differ run to run; they are scored alone, so
    they equal the request alone bit for bit however they arrive."""
    square, tall = images(8, seed=11, size=(32, 32)), images(8, seed=12, size=(31, 32))
    text = judge_instruction(None)
    triples = [(square[i], tall[i], text) for i in range(8)]
    grids = judge.encode([triples[0]])["image_grid_thw"].tolist()
    assert grids[0] != grids[1]
    n_vocab = len(judge.processor.tokenizer)
    alone = [_batch_rows(judge, [t], "single", n_vocab)[0][0] for t in triples]
    together, sizes = _batch_rows(judge, triples + [(square[0], square[1], text)] * 2, "same_shape", n_vocab)
    assert together[:8] == alone
    assert sorted(sizes) == [1] * 8 + [2]  # the uniform-grid requests still share a pass


def test_cancelled_requests_are_not_computed(judge):
    calls: list[int] = []

    class Counting:
        processor = judge.processor
        encode = staticmethod(judge.encode)

        def logits(self, inputs):
            calls.append(int(inputs["input_ids"].shape[0]))
            return judge.logits(inputs)

    batcher = BatchingJudge(Counting(), max_batch_size=8, max_wait_ms=300)
    try:
        a, b = images(2)
        kept = batcher.submit((a, b, "same?"), 5)
        dropped = batcher.submit((b, a, "same?"), 5)
        assert dropped.cancel()  # still queued (the batcher waits up to 300 ms for more)
        assert kept.result(timeout=60)[2] and len(kept.result()[2]) == 5
        assert calls == [1]
    finally:
        batcher.close()


def test_image_feature_cache_is_bit_identical_and_hit(judge):
    """Per-image cached features concatenated = the processor's own batch of both images, bit
    for bit; a repeated image is preprocessed once."""
    prep = RequestPreparer(judge, NAME, ServerLimits(), 5)
    a, b, c = images(3, seed=7, size=(90, 130))
    triples = [(a, b, "same?"), (a, c, "same?"), (c, b, "same?")]
    for triple in triples:
        body = json.dumps(request_body(*triple[:2])).encode()
        got, top_k, inputs = prep(body)
        assert top_k == 5 and got[0].info[IMAGE_KEY] and got[1].info[IMAGE_KEY]
        want = judge.encode([triple])
        assert set(inputs) == set(want)
        for name in want:
            assert torch.equal(inputs[name], want[name]), name
    assert prep.image_features.misses == 3 and prep.image_features.hits == 3
