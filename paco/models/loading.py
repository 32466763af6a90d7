"""Load the model directories written by the ``models`` stage, with ``from_pretrained`` only.

Every later stage loads its models through these functions, so the tiny embedded default and a
real hub snapshot go through the same code. Nothing here touches the network: each loader
passes ``local_files_only=True``.

Classes are chosen so that nothing needs torchvision (docs/architecture.md §10):

* the judge's processor is :class:`Qwen2_5_VLImageOnlyProcessor`, a subclass of
  ``Qwen2_5_VLProcessor`` with an image processor and a tokenizer but no video processor (the
  stock ``AutoProcessor`` builds a torchvision video processor and fails without it), and its
  image processor is always the PIL/numpy ``Qwen2VLImageProcessorPil``, also where torchvision
  is installed, so preprocessing is bit-identical on every machine;
* CLIP's image processor is always ``CLIPImageProcessorPil``, for the same reason.

Weights are checked before and after loading, for every role (judge, CLIP, each torch
component of a diffusers pipeline): every weights file a directory names (the single file or
each shard of its index) must be readable and a complete safetensors file
(:class:`ModelDirectoryError` naming the file and the reason), and the checkpoint's tensors
must be exactly the model's (:class:`WeightsMismatchError` naming the missing, unexpected and
mis-shaped tensors). transformers and diffusers would otherwise random-initialise a missing
tensor with a log line and drop an unexpected one. Tensors a model does not store
(tied embeddings) are not missing.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import ProcessorMixin
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor


class ModelDirectoryError(FileNotFoundError):
    """A model directory is missing, lacks a file a loader needs, or has a weights file that
    cannot be read or is not a complete safetensors file (the message names the file)."""


class WeightsMismatchError(ValueError):
    """A checkpoint's tensors are not the model's: tensors the model needs are missing (they
    would be randomly initialised), tensors it does not know are present, or shapes differ. The
    message names them (at most :data:`MAX_LISTED_TENSORS` of each kind)."""


#: how many tensor names of each kind a :class:`WeightsMismatchError` lists
MAX_LISTED_TENSORS = 10

#: weights files a transformers / diffusers model directory may have, then their indices
_WEIGHT_FILES = ("model.safetensors", "diffusion_pytorch_model.safetensors", "pytorch_model.bin")
_WEIGHT_INDICES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json",
                   "pytorch_model.bin.index.json")
_MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own bound on the JSON header


def _check_dir(path: str | Path, what: str, required: list[str], any_of: list[list[str]] = ()) -> Path:
    """Raise :class:`ModelDirectoryError` unless ``path`` holds every file in ``required`` and at
    least one file of each group in ``any_of`` (paths relative to ``path``)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirectoryError(f"{what}: model directory {path} does not exist (run the `models` stage)")
    missing = [f for f in required if not (path / f).is_file()]
    for group in any_of:
        if not any((path / f).is_file() for f in group):
            missing.append(" or ".join(group))
    if missing:
        raise ModelDirectoryError(f"{what}: model directory {path} is incomplete, missing {missing}")
    return path


_WEIGHTS = ["model.safetensors", "model.safetensors.index.json"]


def _check_safetensors(file: Path, what: str) -> None:
    """Raise :class:`ModelDirectoryError` unless ``file`` can be read and is a complete
    safetensors file (its header parses and every tensor's bytes are in the file)."""
    try:
        with open(file, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > min(size - 8, _MAX_SAFETENSORS_HEADER):
                raise ModelDirectoryError(f"{what}: weights file {file} is not a safetensors file (its {size} bytes "
                                          "do not start with a header length that fits)")
            header = fh.read(n)
    except OSError as exc:
        if isinstance(exc, ModelDirectoryError):
            raise
        raise ModelDirectoryError(f"{what}: cannot read weights file {file}: {exc.strerror or exc} "
                                  f"({type(exc).__name__})") from None
    try:
        entries = json.loads(header)
        end = max((int(v["data_offsets"][1]) for k, v in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ModelDirectoryError(f"{what}: weights file {file} is not a safetensors file (its header is not the "
                                  "JSON table of tensors)") from None
    if 8 + n + end > size:
        raise ModelDirectoryError(f"{what}: weights file {file} is truncated: its tensors need {8 + n + end} bytes, "
                                  f"the file has {size}")


def _check_readable(file: Path, what: str) -> None:
    try:
        with open(file, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise ModelDirectoryError(f"{what}: cannot read weights file {file}: {exc.strerror or exc} "
                                  f"({type(exc).__name__})") from None


def _index_shards(index: Path, what: str) -> list[Path]:
    """The shard files ``index`` (a ``*.index.json``) names, each checked to exist as a file
    beside it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except OSError as exc:
        raise ModelDirectoryError(f"{what}: cannot read weights index {index}: {exc.strerror or exc} "
                                  f"({type(exc).__name__})") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ModelDirectoryError(f"{what}: weights index {index} is not valid JSON with a 'weight_map' of tensor "
                                  f"name -> shard file ({type(exc).__name__}: {exc})") from None
    shards = []
    for name in names:
        rel = Path(name) if isinstance(name, str) else None
        if rel is None or not name or rel.is_absolute() or ".." in rel.parts:
            raise ModelDirectoryError(f"{what}: weights index {index} names the shard {name!r}, not a file beside it")
        if not (index.parent / rel).exists():
            raise ModelDirectoryError(f"{what}: weights file {name} named by {index} does not exist "
                                      f"({index.parent / rel})")
        shards.append(index.parent / rel)
    return shards


def check_weight_files(path: str | Path, what: str) -> list[Path]:
    """Check every weights file of the model directory ``path``: its single weights file(s) and
    every shard its index(es) name; return them.

    Raises:
        ModelDirectoryError: a file cannot be read (the reason: permission, a folder, ...), an
            index is not valid JSON or names a shard that is missing, or a safetensors file is
            not one or is truncated. The message names the file.
    """
    path = Path(path)
    files = [path / f for f in _WEIGHT_FILES if (path / f).exists() or (path / f).is_symlink()]
    for index in _WEIGHT_INDICES:
        if (path / index).exists() or (path / index).is_symlink():
            files += _index_shards(path / index, what)
    for file in dict.fromkeys(files):
        if file.name.endswith(".safetensors"):
            _check_safetensors(file, what)
        else:
            _check_readable(file, what)
    return files


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED_TENSORS])
    more = len(names) - MAX_LISTED_TENSORS
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def check_loading_info(info: Mapping[str, Any], what: str, path: str | Path, model_class: str) -> None:
    """Raise :class:`WeightsMismatchError` unless ``info`` (transformers' or diffusers'
    ``output_loading_info``) reports no missing, unexpected or mis-shaped tensor and no error.

    Raises:
        WeightsMismatchError: naming ``what``, ``path``, ``model_class`` and the tensors.
    """
    def name(entry: Any) -> str:
        if isinstance(entry, (tuple, list)) and entry:
            return f"{entry[0]} {' vs '.join(str(tuple(s)) for s in entry[1:])}".strip()
        return str(entry)

    missing = sorted(str(k) for k in info.get("missing_keys") or ())
    unexpected = sorted(str(k) for k in info.get("unexpected_keys") or ())
    mismatched = sorted(name(k) for k in info.get("mismatched_keys") or ())
    errors = [str(e) for e in info.get("error_msgs") or ()]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s), which would be randomly initialised: {_listed(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), which would be dropped: {_listed(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of another shape (checkpoint vs model): {_listed(mismatched)}")
    if errors:
        problems.append(f"loading errors: {_listed(errors)}")
    if problems:
        raise WeightsMismatchError(f"{what}: the weights in {path} do not match {model_class}: " + "; ".join(problems)
                                   + ". Refusing to load them: was the directory written by another model or "
                                   "version, or copied only in part?")


def _from_pretrained_checked(cls: Any, path: Path, what: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(path, local_files_only=True, **kwargs)`` with its weights checked
    (:func:`check_weight_files`, :func:`check_loading_info`)."""
    check_weight_files(path, what)
    model, info = cls.from_pretrained(str(path), local_files_only=True, output_loading_info=True, **kwargs)
    check_loading_info(info, what, path, type(model).__name__)  # the concrete class where cls is an Auto class
    return model


# --------------------------------------------------------------------------------------------
# judge (Qwen2.5-VL)
# --------------------------------------------------------------------------------------------


#: the image processor's keys a Qwen2.5-VL video processor shares (transformers'
#: ``Qwen2VLVideoProcessor``: frames are resized, rescaled, normalised and patched as images are)
VIDEO_PROCESSOR_SHARED_KEYS = ("size", "do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor",
                               "do_normalize", "image_mean", "image_std", "patch_size", "temporal_patch_size",
                               "merge_size", "min_pixels", "max_pixels")


def video_processor_entry(image_processor: Mapping[str, Any]) -> dict[str, Any]:
    """The ``video_processor`` entry of a saved ``processor_config.json``: the image processor's
    settings (:data:`VIDEO_PROCESSOR_SHARED_KEYS` it has) with ``video_processor_type:
    Qwen2VLVideoProcessor``, every other key the class default. The judge never sends a video; the
    entry is there so that the directory has the stock layout: transformers' ``AutoProcessor``
    (where torchvision is installed) and vLLM build ``Qwen2_5_VLProcessor`` with a video processor
    and refuse a directory without its config (``OSError: Can't load video processor``). Built
    from the image processor's dict, so writing it needs no torchvision."""
    entry = {k: image_processor[k] for k in VIDEO_PROCESSOR_SHARED_KEYS if k in image_processor}
    entry["video_processor_type"] = "Qwen2VLVideoProcessor"
    return entry


class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without a video processor (works without torchvision).

    Takes exactly ``image_processor`` (``Qwen2VLImageProcessorPil``) and ``tokenizer``
    (``Qwen2Tokenizer``) plus an optional ``chat_template``. Calling it with ``videos=`` is an
    error. ``save_pretrained`` writes ``processor_class: "Qwen2_5_VLProcessor"`` and a
    ``video_processor`` entry (:func:`video_processor_entry`) so the saved directory has the stock
    layout (``AutoProcessor`` and vLLM load it where torchvision exists);
    :func:`load_qwen_vl_processor` always reloads it with this class.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        if tokenizer is None or image_processor is None:
            raise ValueError("Qwen2_5_VLImageOnlyProcessor needs an image_processor and a tokenizer")
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("Qwen2_5_VLImageOnlyProcessor handles images only (no video processor)")
        return super().__call__(images=images, text=text, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["processor_class"] = "Qwen2_5_VLProcessor"
        out["video_processor"] = video_processor_entry(out["image_processor"])
        return out

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        files = super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        # The tokenizer config names the processor class too: keep it the stock one as well.
        tok_config = Path(save_directory) / "tokenizer_config.json"
        if tok_config.is_file():
            data = json.loads(tok_config.read_text(encoding="utf-8"))
            if data.get("processor_class") == type(self).__name__:
                data["processor_class"] = "Qwen2_5_VLProcessor"
                tok_config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return files

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        # Always the PIL image processor; the tokenizer through AutoTokenizer (Qwen2Tokenizer).
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        kwargs.pop("backend", None)
        kwargs.pop("use_fast", None)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(pretrained_model_name_or_path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [image_processor, tokenizer]


def load_qwen_vl_processor(path: str | Path) -> Qwen2_5_VLImageOnlyProcessor:
    """Load a Qwen2.5-VL processor (image processor + tokenizer + chat template) from ``path``,
    image-only (:class:`Qwen2_5_VLImageOnlyProcessor`): the judge's, and the Qwen-Image-Edit
    policy's text encoder's (``processor/``, :mod:`paco.grpo.policies.qwen_image`).

    Works for the tiny build and for a Qwen2.5-VL hub snapshot (``preprocessor_config.json`` or
    ``processor_config.json``). Chat messages use the Qwen format:
    ``{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ...}]}``;
    ``processor(text=..., images=[PIL images])`` returns ``input_ids``, ``attention_mask``
    (int64, ``(batch, seq)``), ``pixel_values`` (float32, ``(n_patches, 3*2*14*14)``),
    ``image_grid_thw`` (int64, ``(n_images, 3)``) and ``mm_token_type_ids``.

    Raises:
        ModelDirectoryError: ``path`` is missing or has no tokenizer / processor config.
    """
    path = _check_dir(
        path,
        "Qwen2.5-VL processor",
        [],
        [["tokenizer.json", "vocab.json"], ["processor_config.json", "preprocessor_config.json"]],
    )
    return Qwen2_5_VLImageOnlyProcessor.from_pretrained(str(path), local_files_only=True)


def load_judge(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load the Qwen2.5-VL judge and its processor from ``path``.

    Args:
        path: a directory written by the ``models`` stage (``judge_base``) or by
            ``reward_merge`` (config, safetensors weights, processor files).
        dtype: parameter dtype (``torch.float32`` on CPU; ``torch.bfloat16`` on GPU).

    Returns:
        ``(model, processor)``: ``Qwen2_5_VLForConditionalGeneration`` in eval mode on CPU
        (move it yourself), and :class:`Qwen2_5_VLImageOnlyProcessor`. ``model(**inputs).logits``
        has shape ``(batch, seq, vocab_size)``.

    Raises:
        ModelDirectoryError: ``path`` is missing or lacks ``config.json``, weights or processor,
            or a weights file cannot be read or is incomplete (:func:`check_weight_files`).
        WeightsMismatchError: the checkpoint's tensors are not the model's.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = _check_dir(path, "judge", ["config.json"], [_WEIGHTS])
    processor = load_qwen_vl_processor(path)
    model = _from_pretrained_checked(Qwen2_5_VLForConditionalGeneration, path, "judge", dtype=dtype)
    model.eval()
    return model, processor


# --------------------------------------------------------------------------------------------
# any image-text-to-text model (the benchmarks' in-process evaluator)
# --------------------------------------------------------------------------------------------

#: the weights a transformers model directory may have: a single file or an index of shards
_TRANSFORMERS_WEIGHTS = _WEIGHTS + ["pytorch_model.bin", "pytorch_model.bin.index.json"]


def check_transformers_dir(path: str | Path, what: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it is a transformers model directory with
    ``config.json`` and complete weights (``model.safetensors``, ``pytorch_model.bin`` or an index
    of either's shards; every file checked by :func:`check_weight_files`), before anything is
    loaded.

    Raises:
        ModelDirectoryError: ``path`` does not exist, lacks ``config.json`` or a weights file, or
            a weights file cannot be read or is incomplete; the message names ``what`` and the
            path or file.
    """
    path = _check_dir(path, what, ["config.json"], [_TRANSFORMERS_WEIGHTS])
    check_weight_files(path, what)
    return path


def load_image_text_to_text(path: str | Path, *, dtype: torch.dtype | str = torch.float32,
                            what: str = "image-text-to-text model"):
    """Load a vision-language model directory as ``transformers.AutoModelForImageTextToText``
    and its processor, weights checked as every model of the project (module docstring).

    The processor is :func:`load_qwen_vl_processor` for ``model_type: qwen2_5_vl`` in
    ``config.json`` (image-only, no torchvision), else ``AutoProcessor``.

    Args:
        path: a model directory (:func:`check_transformers_dir`), e.g. ``judge_base``.
        dtype: parameter dtype (``torch.float32`` on CPU, ``torch.bfloat16`` on GPU), or
            ``"auto"``: the checkpoint's own ``torch_dtype``.
        what: the model's role in error messages.

    Returns:
        ``(model, processor)``: the model class ``config.json`` maps to (for Qwen2.5-VL
        ``Qwen2_5_VLForConditionalGeneration``) in eval mode on CPU (move it yourself);
        ``model(**inputs).logits`` has shape ``(batch, seq, vocab_size)``.

    Raises:
        ModelDirectoryError: see :func:`check_transformers_dir`.
        WeightsMismatchError: the checkpoint's tensors are not the model's.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = _check_dir(path, what, ["config.json"], [_TRANSFORMERS_WEIGHTS])  # the weights: _from_pretrained_checked
    model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    processor = (load_qwen_vl_processor(path) if model_type == "qwen2_5_vl"
                 else AutoProcessor.from_pretrained(str(path), local_files_only=True))
    model = _from_pretrained_checked(AutoModelForImageTextToText, path, what, dtype=dtype)
    return model.eval(), processor


# --------------------------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------------------------


def load_clip(path: str | Path):
    """Load a CLIP dual encoder and its processor from ``path``.

    Returns:
        ``(CLIPModel in eval mode, CLIPProcessor)``; the processor's image processor is
        ``CLIPImageProcessorPil`` (resize shortest edge + centre crop to
        ``model.config.vision_config.image_size``, CLIP mean/std normalisation).

    Raises:
        ModelDirectoryError: ``path`` is missing or lacks ``config.json``, weights, tokenizer or
            image processor config, or a weights file cannot be read or is incomplete.
        WeightsMismatchError: the checkpoint's tensors are not the model's.
    """
    from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    path = _check_dir(
        path,
        "clip",
        ["config.json"],
        [_WEIGHTS + ["pytorch_model.bin"], ["tokenizer.json", "vocab.json"],
         ["processor_config.json", "preprocessor_config.json"]],
    )
    image_processor = CLIPImageProcessorPil.from_pretrained(str(path), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)
    model = _from_pretrained_checked(CLIPModel, path, "clip")
    model.eval()
    return model, processor


# --------------------------------------------------------------------------------------------
# FLUX
# --------------------------------------------------------------------------------------------

_FLUX_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def _diffusers_dtype(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``dtype=`` for diffusers versions that renamed ``torch_dtype`` (and warn on it)."""
    try:
        from diffusers.utils import deprecation_utils

        renamed = hasattr(deprecation_utils, "_TORCH_DTYPE_DEPRECATION_MESSAGE")
    except ImportError:
        renamed = False
    return {"dtype": dtype} if renamed else {"torch_dtype": dtype}


def _load_torch_components(path: Path, index: Mapping[str, Any], what: str, dtype: torch.dtype,
                           skip: set[str]) -> dict[str, Any]:
    """The torch modules of a pipeline directory (``model_index.json``'s transformers and
    diffusers model classes), loaded as the pipeline would (same class, dtype, sub-folder) but
    with their weights checked; other components are left to the pipeline."""
    import diffusers
    import transformers

    modules = {}
    for name, spec in index.items():
        if name.startswith("_") or name in skip or not isinstance(spec, list) or len(spec) != 2:
            continue
        library, class_name = spec
        if library not in ("transformers", "diffusers") or not isinstance(class_name, str):
            continue
        model_class = getattr(importlib.import_module(library), class_name, None)
        if not isinstance(model_class, type):
            continue  # the pipeline reports an unknown class itself
        if issubclass(model_class, transformers.PreTrainedModel):
            kwargs: dict[str, Any] = {"dtype": dtype}
        elif issubclass(model_class, diffusers.ModelMixin):
            kwargs = _diffusers_dtype(dtype)
        else:
            continue
        modules[name] = _from_pretrained_checked(model_class, path / name, f"{what} component {name!r}", **kwargs)
    return modules


def load_pipeline(path: str | Path, pipeline_class: str, components: Sequence[str],
                  dtype: torch.dtype = torch.float32, overrides: Mapping[str, Any] | None = None):
    """Load a diffusers pipeline directory as ``diffusers.<pipeline_class>``.

    The directory's own ``model_index.json`` class may differ when the components are the same
    (a FLUX.1-dev directory loads as ``FluxKontextPipeline``: the released Kontext config does
    exactly that); diffusers then warns, and the components decide.

    Args:
        path: directory with ``model_index.json`` and one sub-folder per name in ``components``.
        pipeline_class: a diffusers pipeline class name (``FluxPipeline``, ``FluxKontextPipeline``,
            ``QwenImageEditPipeline``).
        components: sub-folders the directory must have.
        dtype: dtype of every module (``torch.float32`` on CPU, ``torch.bfloat16`` on GPU).
        overrides: components already loaded (e.g. Qwen-Image-Edit's processor, image-only),
            passed to ``from_pretrained``.

    Every torch component ``model_index.json`` names (transformer, VAE, text encoders) is loaded
    here with its weights checked (:func:`check_weight_files`, :func:`check_loading_info`) and
    handed to the pipeline, which loads the rest (tokenizers, scheduler).

    Returns:
        The pipeline on CPU with the progress bar disabled.

    Raises:
        ModelDirectoryError: ``path`` is missing, lacks ``model_index.json`` or a component, or a
            component's weights file cannot be read or is incomplete.
        WeightsMismatchError: a component's checkpoint tensors are not its model's.
        ValueError: ``pipeline_class`` is not a diffusers pipeline.
    """
    import diffusers

    what = f"{pipeline_class} directory"
    path = _check_dir(path, what, ["model_index.json"])
    index = json.loads((path / "model_index.json").read_text())
    missing = [c for c in components if c not in index or not (path / c).is_dir()]
    if missing:
        raise ModelDirectoryError(f"{what}: model directory {path} is incomplete, missing {missing}")
    cls = getattr(diffusers, pipeline_class, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"{pipeline_class!r} is not a diffusers pipeline class")
    from diffusers.utils import logging as df_logging

    level = df_logging.get_verbosity()
    if overrides:  # diffusers warns that an override is not the class model_index.json names
        df_logging.set_verbosity_error()
    try:
        modules = _load_torch_components(path, index, what, dtype, skip=set(overrides or {}))
        pipe = cls.from_pretrained(str(path), local_files_only=True, **_diffusers_dtype(dtype), **dict(overrides or {}),
                                   **modules)
    finally:
        df_logging.set_verbosity(level)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_flux_pipeline(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a FLUX.1 pipeline directory (diffusers layout) as ``diffusers.FluxPipeline``
    (:func:`load_pipeline`).

    Args:
        path: directory with ``model_index.json`` and the sub-folders ``transformer``, ``vae``,
            ``text_encoder``, ``text_encoder_2``, ``tokenizer``, ``tokenizer_2``, ``scheduler``.
        dtype: dtype of every module (``torch.float32`` on CPU, ``torch.bfloat16`` on GPU).

    Returns:
        ``FluxPipeline`` on CPU with the progress bar disabled. ``pipe(prompt, height=128,
        width=128, num_inference_steps=2, ...)`` gives PIL images of that size; height and width
        must be multiples of ``2 * pipe.vae_scale_factor`` (16 for FLUX).

    Raises:
        ModelDirectoryError: ``path`` is missing, lacks ``model_index.json`` or a component.
    """
    return load_pipeline(path, "FluxPipeline", _FLUX_COMPONENTS, dtype)
