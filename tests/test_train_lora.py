"""LoRA runs checkpoint the adapter, not the base: bytes, resume, --init-from, another base refused.

The base is a small random Llama (hidden 512, 2 layers: 5 M parameters, 20 MB) next to the
``tts`` recipe's audio modules (3 codebooks of 16 codes), so that the trainable part is a few
percent of it as with a real LM (a 1-8 B LM dwarfs Higgs-Audio's 8 x 1026 codebook tables the same
way). The tiny ``lm-tiny`` of the other tests is too small for that: its 8 x 1026 x 64 audio
tables outweigh it 7 to 1. A step dir holds the trainable tensors once (adapter.safetensors) and
twice more in AdamW's moments (optimizer.pt).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_train_recipes_cli import BYTES_TOKENIZER, _tts_cache
from test_train_support import TINY_MODEL, make_cache, read_metrics
from test_train_support import from_dict
from train.trainer import Callbacks, run

pytestmark = pytest.mark.slow


def _llama(path: Path, seed: int) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1024,
        vocab_size=272, max_position_embeddings=512)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    return {"lm": _llama(root / "llama", 0), "other_lm": _llama(root / "llama-other", 1),
            "cache": _tts_cache(root / "cache")}


def _cfg(s, out: Path, **kw):
    # the LMs here ship no tokenizer: the run names the cache's (the tts contract compares it) with --model.contract
    base = dict(cache=str(s["cache"]), out=str(out), model="tts", model_kwargs={"lm": str(s["lm"])}, lora=True,
                **{"model.contract": {"text_tokenizer": BYTES_TOKENIZER}},
                batch_size=4, steps=4, warmup_steps=0, lr=1e-3, ckpt_every=2, keep=2, log_every=1,
                validation=False, progress=False, threads=1)
    base.update(kw)
    return from_dict(base)


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.raw.named_parameters() if p.requires_grad}


def test_lora_checkpoint_holds_the_adapter_only_and_resumes_bitwise(setup, tmp_path):
    from safetensors.torch import load_file
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(_cfg(setup, a, steps=4)) == 0
    ck = a / "step-4"
    names = sorted(p.name for p in ck.iterdir())
    assert "model.safetensors" not in names and {"adapter.safetensors", "adapter.json"} <= set(names)
    base_bytes = (setup["lm"] / "model.safetensors").stat().st_size
    adapter_bytes = (ck / "adapter.safetensors").stat().st_size
    ckpt_bytes = sum(p.stat().st_size for p in ck.iterdir())
    print(f"LoRA checkpoint: adapter {adapter_bytes} B, whole step dir {ckpt_bytes} B, base model {base_bytes} B: "
          f"{adapter_bytes / base_bytes:.3%} / {ckpt_bytes / base_bytes:.3%}")
    assert adapter_bytes < 0.05 * base_bytes and ckpt_bytes < 0.10 * base_bytes
    meta = json.loads((ck / "adapter.json").read_text())
    assert meta["base"] == str(setup["lm"]) and len(meta["base_fingerprint"]) == 64
    assert meta["lora"]["r"] == 8
    saved = load_file(str(ck / "adapter.safetensors"))
    assert any("lora_A" in k for k in saved) and any(k.startswith("audio_") for k in saved)
    assert not any("base_layer" in k for k in saved)  # frozen base weights are not in it
    # stop at 2 and resume from the adapter checkpoint: the same adapter as the run that did not stop
    assert run(_cfg(setup, b, steps=4, stop_at_step=2)) == 3
    assert run(_cfg(setup, b, steps=4, resume="auto")) == 0
    assert [r["loss"] for r in read_metrics(a)] == [r["loss"] for r in read_metrics(b)]
    again = load_file(str(b / "step-4" / "adapter.safetensors"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)


def test_init_from_an_adapter_and_a_full_checkpoint(setup, tmp_path):
    from safetensors.torch import load_file
    src = tmp_path / "src"
    assert run(_cfg(setup, src, steps=2)) == 0
    seen = {}
    cb = Callbacks(on_setup=lambda t: seen.update(params=_trainable(t)))
    assert run(_cfg(setup, tmp_path / "init", steps=1, init_from=str(src / "step-2")), cb) == 0
    saved = load_file(str(src / "step-2" / "adapter.safetensors"))
    assert seen["params"].keys() == saved.keys() and all(torch.equal(seen["params"][k], saved[k]) for k in saved)
    # an adapter trained on another base is refused, naming it
    with pytest.raises(ValueError, match="trained on the base .*refusing"):
        run(_cfg(setup, tmp_path / "other", steps=1, init_from=str(src / "step-2"),
                 model_kwargs={"lm": str(setup["other_lm"])}))
    with pytest.raises(ValueError, match="LoRA adapter checkpoint: enable --lora"):
        run(_cfg(setup, tmp_path / "nolora", steps=1, lora=False, init_from=str(src / "step-2")))
    # a full checkpoint (no LoRA) initialises every weight
    cache = make_cache(tmp_path / "ref-cache", n=12)
    ref = dict(cache=str(cache), model_kwargs=TINY_MODEL, batch_size=4, steps=1, ckpt_every=1, progress=False,
               threads=1, validation=False, warmup_steps=0)
    assert run(from_dict({**ref, "out": str(tmp_path / "full")})) == 0
    cb = Callbacks(on_setup=lambda t: seen.update(full={k: v.clone() for k, v in t.raw.state_dict().items()}))
    assert run(from_dict({**ref, "out": str(tmp_path / "full2"), "init_from": str(tmp_path / "full" / "step-1"),
                          "seed": 5}), cb) == 0
    want = load_file(str(tmp_path / "full" / "step-1" / "model.safetensors"))
    assert all(torch.equal(seen["full"][k], want[k]) for k in want)


def test_base_fingerprint_samples_inside_every_tensor_size():
    """The frozen-base fingerprint reads evenly spaced elements of each tensor, first and last included,
    for sizes where float32 cannot hold n - 1 (Llama-3.2-1B's embedding, 262,668,288 elements, made a
    float32 linspace index one past the end: IndexError at the trainer's start)."""
    from train.checkpoint import base_fingerprint
    n = 2 ** 24 + 4   # float32(n - 1) == n
    p = torch.nn.Parameter(torch.arange(n, dtype=torch.int32), requires_grad=False)
    m = torch.nn.Module()
    m.register_parameter("w", p)
    first = base_fingerprint(m, samples=5)
    # the sampled elements are 0, (n-1)/4, ...: changing the last element changes the fingerprint,
    # changing one between the samples does not
    with torch.no_grad():
        p[n - 1] = -1
    assert base_fingerprint(m, samples=5) != first
    with torch.no_grad():
        p[n - 1] = n - 1
        p[1] = -1
    assert base_fingerprint(m, samples=5) == first
