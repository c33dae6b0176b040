"""Assemble a small vision-language model for vLLM on CPU: SmolVLM's architecture (Idefics3) around SmolLM2-135M.

No vision-language model small enough for this machine ships in a registry package, so one is put
together here with transformers: the language model is the prepared SmolLM2-135M-Instruct with its
real weights (SmolVLM is SmolLM2 behind a SigLIP vision tower), behind a small SigLIP-style vision
tower and connector initialised at random (a fixed seed). Its answers about images mean nothing; the
engine, the processor, the image tokens in the prompt and the token ids are real, which is what the
tests need. (vLLM's LLaVA needs torchvision, which the CPU engine cannot have; its Idefics3 does not.)
Run with the engine's Python (torch and transformers are there, not in gym-grpc's environment):

    ENGINE_PYTHON -m gym_grpc.engines.local_vllm.vision_model TEXT_MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

#: The vision tower's input: 64x64 pixels in 16x16 patches, pixel-shuffled by 2: 4 image tokens an image.
IMAGE_SIZE, PATCH, SCALE = 64, 16, 2
SEED = 0
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)
]


def assemble(text_dir: Path, out: Path) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    text.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    vision = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH,
    )  # fmt: skip
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.config.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE,
        pad_token_id=text.config.pad_token_id,
        tie_word_embeddings=True,
    )
    model = Idefics3ForConditionalGeneration(config)
    model.model.text_model.load_state_dict(text.model.state_dict())
    model.lm_head.weight = model.model.text_model.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(out)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False
    )
    seq_len = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2
    template = text_dir / "chat_template.jinja"
    processor = Idefics3Processor(
        images, tokenizer, image_seq_len=seq_len, chat_template=template.read_text() if template.exists() else None
    )
    processor.save_pretrained(out)
    if (text_dir / "generation_config.json").exists():
        shutil.copy(text_dir / "generation_config.json", out / "generation_config.json")


if __name__ == "__main__":
    assemble(Path(sys.argv[1]), Path(sys.argv[2]))
