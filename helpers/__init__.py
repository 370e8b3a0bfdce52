"""Tested building blocks of the course "GPT from scratch, fast"; notebooks import them."""

from .model.config import PRESETS, GPTConfig
from .model.gpt import GPT
from .system.device import autocast_dtype, detect_capabilities, dtype_name, needs_grad_scaler
from .system.env import environment_line, environment_report
from .system.optional import quiet_expected_library_logs
from .system.scale import by_scale, current_scale
from .text.data import load_corpus, load_token_ids, make_dataloader, train_val_split
from .text.tokenizer import get_tokenizer

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "autocast_dtype",
    "by_scale",
    "current_scale",
    "detect_capabilities",
    "dtype_name",
    "environment_line",
    "environment_report",
    "get_tokenizer",
    "load_corpus",
    "load_token_ids",
    "make_dataloader",
    "needs_grad_scaler",
    "train_val_split",
]

quiet_expected_library_logs()
