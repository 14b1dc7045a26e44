"""Small GGUF files written on the fly for loader and CLI tests."""
from pathlib import Path

import numpy as np


def write_header_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF with one tensor and no tokenizer: enough for the loader to read its architecture."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
