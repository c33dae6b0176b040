"""Dequantize a GGUF model into a Hugging Face directory that vLLM's CPU build loads.

Runs in the engine's virtualenv (transformers, gguf, torch), not in gym-grpc's:
    python convert_gguf.py MODEL.gguf OUTPUT_DIR
vLLM 0.32 does not load GGUF itself. transformers dequantizes on load; its
quantizer and the config's quantization_config would make save_pretrained
write a model vLLM takes for a quantized one, so both are dropped.
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf, output = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    print(f"saved {output}")


if __name__ == "__main__":
    main()
