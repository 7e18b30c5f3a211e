"""What a converted Megatron checkpoint carries beside the trainer's files, for the way back and
for the user: hf_config/ (the Hugging Face config and tokenizer files, copied as they were) and
convert_info.json (the conversion's settings and the trainer flags that rebuild the model).
The trainer reads neither."""
from __future__ import annotations

import json
import os

HF_CONFIG_DIR = "hf_config"
INFO_FILE = "convert_info.json"


def write_info(root: str, info: dict) -> None:
    with open(os.path.join(root, INFO_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)


def read_info(root: str) -> dict:
    path = os.path.join(root, INFO_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
