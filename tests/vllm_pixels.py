"""Run inside the vLLM environment (not the project's): the ``pixel_values`` vLLM's engine computes for
chat requests, with the processor it builds from a server command line.

    <vllm python> tests/vllm_pixels.py OUT.npz < request.json

``request.json``: ``{"argv": [the server's flags after the module name], "requests": [{"text": the
prompt as the chat template renders it, "images": [base64 PNG, ...]}, ...]}``. The flags are parsed
by vLLM's own server parser into its ``ModelConfig``; the processor is the one vLLM's multimodal
registry builds for it (so ``--mm-processor-kwargs`` acts as in the server), called through vLLM's
processing context as the engine calls it, on the images decoded as vLLM decodes a data URL (PIL,
RGB). ``OUT.npz`` holds ``pixel_values_<i>`` (float32) and ``image_grid_thw_<i>`` per request, and
``image_processor`` (the class name).
"""

from __future__ import annotations

import base64
import io
import json
import sys

import numpy as np
from PIL import Image


def main() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = json.load(sys.stdin)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(spec["argv"])
    model_config = EngineArgs.from_cli_args(args).create_model_config()
    info = MULTIMODAL_REGISTRY.create_processor(model_config).info
    hf = info.get_hf_processor()
    out = {"image_processor": np.array(type(hf.image_processor).__name__)}
    for i, request in enumerate(spec["requests"]):
        images = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in request["images"]]
        got = info.ctx.call_hf_processor(hf, {"text": request["text"], "images": images}, {})
        out[f"pixel_values_{i}"] = got["pixel_values"].float().numpy()
        out[f"image_grid_thw_{i}"] = got["image_grid_thw"].numpy()
    np.savez(sys.argv[1], **out)


if __name__ == "__main__":
    main()
