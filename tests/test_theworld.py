"""TheWorld from a cache (issue 21, items 4 and 5): Gemma 3's vision tower runs once at stage one
(``image_features``), and ``--model.name theworld`` trains Gemma 3 + TheWorld's world projection on the
cached tensors alone.

Gemma 3's processor and vision tower are run here independently of the code under test
(``transformers``' ``Gemma3Processor`` on the image file, ``Gemma3ForConditionalGeneration
.get_image_features``), on real-mini's LLaVA multi-turn manifest and the tiny random Gemma 3 of
``tools.testing``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from shards import Cache

MANIFEST = "llava_multiturn.json"
#: pixels of the VAE input in these tests (the preset's 512 gives 4096 world tokens per image:
#: 6 s per step on 2 CPU processes; 64 gives 64, and the same code paths)
IMAGE_SIZE = 64
#: the preset's options these tests' caches change (besides IMAGE_SIZE): Gemma 3's own chat template and
#: answers-only labels, what the on-the-fly comparisons below render; the recipe is told so (its contract
#: defaults to TheWorld's preset: 512 px, chat_template theworld, label_policy all_but_world)
PRESET = ["chat_template=auto", "label_policy=answers"]
KW = {"image_size": IMAGE_SIZE, "chat_template": "tokenizer", "label_policy": "answers"}


@pytest.fixture(autouse=True)
def _vae(tiny_models, monkeypatch):
    """The caches here are made with the tiny Wan VAE: the recipe compares its weights (``model.kwargs.vae``;
    TheWorld's default, the Cosmos-Predict2 pipeline's, is not here)."""
    monkeypatch.setitem(KW, "vae", str(tiny_models / "wan-tiny"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    """The tiny random Gemma 3 + processor (what ``python -m tools.testing --only gemma3`` writes)."""
    from tools.testing import build
    path, _ = build("gemma3", tmp_path_factory.mktemp("gemma3"))
    return path


@pytest.fixture(scope="module")
def world_cache(real_mini, tiny_models, gemma3, tmp_path_factory) -> Path:
    """real-mini's LLaVA multi-turn manifest through configs/precompute-theworld.yaml (image_features on)."""
    from precompute.config import load_config
    from precompute.job import run
    from precompute.validate import validate_config
    cfg = validate_config(load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        f"image_encoder.pretrained={tiny_models / 'wan-tiny'}", f"text_tokenizer.pretrained={gemma3}",
        f"image_features.pretrained={gemma3}", f"image_size={IMAGE_SIZE}", "device=cpu", "num_workers=0", *PRESET]))
    out = tmp_path_factory.mktemp("theworld") / "cache"
    summary, _ = run(real_mini / MANIFEST, out, cfg, progress=False)
    assert summary.kept == 8 and summary.rejected == 0, summary.reasons
    return out


def _samples(cache: Path) -> dict[str, dict]:
    from shards import ShardReader
    r = ShardReader(cache)
    return {k: r.get(i) for i, k in enumerate(r.keys)}


def _processor(gemma3: Path):
    """Gemma 3's own processor, with TheWorld's world markers added to its tokenizer (as TheWorld does)."""
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(str(gemma3))
    proc.tokenizer.add_tokens(["<start_of_world>", "<end_of_world>"], special_tokens=True)
    return proc


def _on_the_fly(proc, record: dict, real_mini: Path) -> tuple[dict, str]:
    """What TheWorld feeds Gemma 3 on the fly for a LLaVA record: the conversation through Gemma's
    chat template (``<image>`` -> ``<start_of_image>``), one world-marker pair per image after
    ``<bos>``, then ``Gemma3Processor(text, images)`` (the file opened with Pillow)."""
    from PIL import Image
    roles = {"human": "user", "gpt": "assistant"}
    msgs = [{"role": roles[t["from"]], "content": t["value"].replace("<image>", "<start_of_image>")}
            for t in record["conversations"]]
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text.startswith("<bos>")
    text = "<bos>" + "<start_of_world><end_of_world>" + text[len("<bos>"):]
    image = Image.open(real_mini / record["image"])
    out = proc(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    return out, text


def test_cached_image_features_and_ids_are_gemma3s_own(world_cache, gemma3, real_mini):
    """Done-when: Gemma 3's processor + vision tower, run here on the same real-mini image, give the
    cached image_features (bfloat16, bit for bit up to bf16 rounding), and the cached input_ids equal
    the processor's for the same rendered text (the expanded image sequence included, labels -100 on it)."""
    from transformers import Gemma3ForConditionalGeneration
    proc = _processor(gemma3)
    model = Gemma3ForConditionalGeneration.from_pretrained(str(gemma3), dtype=torch.bfloat16).eval()
    got = _samples(world_cache)
    records = {r["id"]: r for r in json.loads((real_mini / MANIFEST).read_text())}
    soft = model.config.image_token_id
    for key, s in got.items():
        out, _ = _on_the_fly(proc, records[key], real_mini)
        assert s["input_ids"].tolist() == out["input_ids"][0].tolist(), key
        assert (s["labels"][out["token_type_ids"][0].numpy() == 1] == -100).all()
        assert int((s["input_ids"] == soft).sum()) == model.config.mm_tokens_per_image
        with torch.no_grad():
            want = model.model.get_image_features(out["pixel_values"].to(torch.bfloat16)).pooler_output  # (1, 16, 64)
        bits = s["image_features"]
        assert bits.dtype == np.int16 and bits.shape == tuple(want.shape)
        cached = torch.from_numpy(bits.copy()).view(torch.bfloat16)
        # the same ops on the same bf16 weights and pixels: equal within one bf16 step
        torch.testing.assert_close(cached.float(), want.float(), rtol=2 ** -7, atol=1e-3)
        assert float(want.float().abs().mean()) > 1e-2                 # not a comparison of zeros
    man = json.loads((world_cache / "manifest.json").read_text())
    info = man["fields"]["image_features"]
    assert info["kind"] == "bf16_bits" and info["tokens_per_image"] == 16 and info["dtype"] == "bfloat16"
    assert man["text"]["image_sequence"] == proc.full_image_sequence
    assert man["encoders"]["preprocessing"]["image_features"]["name"] == "gemma3"


def test_bf16_bits_kind_is_exact_in_both_batch_dtypes(world_cache):
    """The kind owns the layout: a compact batch holds the int16 bits and the device move gives
    bfloat16 (a view); a full batch holds float32; both equal the stored bf16 values exactly."""
    from loaders import Reads, ShardLoader, Workers
    from loaders.device import to_device
    stored = {k: torch.from_numpy(s["image_features"].copy()).view(torch.bfloat16) for k, s in _samples(world_cache).items()}
    for compact, host, dev in ((True, torch.int16, torch.bfloat16), (False, torch.float32, torch.float32)):
        ld = ShardLoader(world_cache, 3, fields=("input_ids", "image_features"), seed=0, workers=Workers(num_workers=0), reads=Reads(compact=compact))
        for b in ld:
            assert b["image_features"].dtype == host and b["image_features_mask"].shape == b["image_features"].shape[:2]
            d = to_device(b, "cpu")
            assert d["image_features"].dtype == dev
            for j, key in enumerate(b["keys"]):
                assert torch.equal(d["image_features"][j, :1].float(), stored[key].float())
        ld.close()


def test_cached_batch_gives_the_on_the_fly_loss(world_cache, gemma3, real_mini):
    """Done-when: the batch the loader yields for the theworld cache, through the recipe, gives the
    loss the recipe gives on the processor's outputs with pixel values through the real vision tower."""
    from loaders import Reads, ShardLoader, Workers
    from loaders.device import to_device
    from train.models import build_model
    torch.manual_seed(0)
    model = build_model("theworld", {**KW, "lm": str(gemma3), "vision_tower": True}, world_cache).eval()
    ld = ShardLoader(world_cache, 3, fields=model.fields, seed=0, workers=Workers(num_workers=0), reads=Reads(compact=True))
    batch = to_device(next(iter(ld)), "cpu")
    ld.close()
    proc = _processor(gemma3)
    records = {r["id"]: r for r in json.loads((real_mini / MANIFEST).read_text())}
    outs = [_on_the_fly(proc, records[k], real_mini)[0] for k in batch["keys"]]
    L = max(o["input_ids"].shape[1] for o in outs)
    ids = torch.full((len(outs), L), proc.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(outs), L), dtype=torch.bool)
    for j, o in enumerate(outs):
        n = o["input_ids"].shape[1]
        ids[j, :n], mask[j, :n] = o["input_ids"][0], True
    fly = {"input_ids": ids, "attention_mask": mask, "labels": batch["labels"],
           "pixel_values": torch.cat([o["pixel_values"] for o in outs]),
           "latents": batch["latents"], "latents_mask": batch["latents_mask"]}
    assert torch.equal(ids, batch["input_ids"])
    with torch.no_grad():
        cached, on_the_fly = model(batch)["loss"], model(fly)["loss"]
        torch.testing.assert_close(cached, on_the_fly, rtol=1e-4, atol=1e-4)
        # the features matter: zeroing them changes the loss (so the comparison above can fail)
        zeroed = dict(batch, image_features=torch.zeros_like(batch["image_features"]))
        assert abs(float(model(zeroed)["loss"]) - float(cached)) > 1e-3
    assert model.lm.model.vision_tower is not None
    plain = build_model("theworld", {**KW, "lm": str(gemma3)}, world_cache)
    assert plain.lm.model.vision_tower is None and plain.lm.model.multi_modal_projector is None
    with pytest.raises(ValueError, match="vision_tower: true"):
        plain(fly)


def test_lm_inputs_put_features_and_world_tokens_where_gemma_and_theworld_do(world_cache, gemma3):
    """The recipe's LM inputs, checked position by position against values computed here: the
    positions marked ``token_type_ids == 1`` (Gemma 3's bidirectional image attention) hold exactly
    the cached image features, in order, as many per sample as its ``<image_soft_token>``s; after
    the k-th ``<start_of_world>`` come TheWorld's projected latent cells of image k (one per cell,
    row-major), then ``<end_of_world>``'s own embedding."""
    from loaders import Reads, ShardLoader, Workers
    from loaders.device import to_device
    from train.models import build_model
    from train.recipes.base import cache_values
    spec = cache_values(Cache.open(world_cache))
    model = build_model("theworld", {**KW, "lm": str(gemma3)}, world_cache).eval()
    ld = ShardLoader(world_cache, 3, fields=model.fields, seed=0, workers=Workers(num_workers=0), reads=Reads(compact=False))
    batch = to_device(next(iter(ld)), "cpu")
    ld.close()
    with torch.no_grad():
        merged, token_type = model.inputs(batch)
        embed = model.lm.get_input_embeddings()
        feats = batch["image_features"][batch["image_features_mask"]].flatten(0, 1)   # (n_images * T, D)
        marked = merged.inputs_embeds[token_type.bool()]
        assert marked.shape == feats.shape
        torch.testing.assert_close(marked, feats.to(marked.dtype))
        n_soft = (batch["input_ids"] == spec["image_soft_token_id"]).sum(1)
        assert torch.equal(token_type.sum(1), n_soft)
        for b in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
            row = merged.inputs_embeds[b]
            sow = (ids == spec["world_start_token_id"]).nonzero().flatten().tolist()
            shift = 0   # world tokens inserted before the current marker
            for k, at in enumerate(sow):
                lat = batch["latents"][b, :, k]                                       # (C, H, W)
                cells = lat.flatten(1).T                                              # (H*W, C) row-major
                world = model.world_projector.projection(cells.to(row.dtype))
                start = at + shift + 1
                torch.testing.assert_close(row[start:start + len(cells)], world)
                eow = embed(torch.tensor([spec["world_end_token_id"]]))[0]
                torch.testing.assert_close(row[start + len(cells)], eow.to(row.dtype))
                shift += len(cells)
            assert len(sow) > 0


def _train(cache: Path, run_dir: Path, gemma3: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc_per_node={nproc}"]
    cmd = head + ["-m", "shardcache", "train", "--cache", str(cache), "--run_dir", str(run_dir), "--config",
                  str(ROOT / "configs" / "train-theworld.yaml"), "--model.kwargs", json.dumps({**KW, "lm": str(gemma3)}),
                  "--metrics.progress=false", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)


def _losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r and r.get("split") != "val"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.long)])
def test_theworld_trains_and_the_loss_falls(nproc, world_cache, gemma3, tmp_path):
    """Done-when: `shardcache train --model.name theworld` (configs/train-theworld.yaml) on the real-mini
    LLaVA multi-turn cache, 60 steps: the loss falls below 0.8 x its start; the trainable fraction is
    logged; only the world projection and the LoRA adapters are saved. The profile of steps 3-5
    holds no convolution or pooling (no VAE, no SigLIP patch embedding or pooling: nothing of the
    image path runs in a step)."""
    profile = ["--profile.enabled=true", "--profile.wait", "1", "--profile.warmup", "1",
               "--profile.active", "3"] if nproc == 1 else []
    r = _train(world_cache, tmp_path / "run", gemma3, nproc, *profile)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert len(losses) == 60
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (nproc, first, last)
    assert "TheWorldModel: trainable fraction" in r.stderr and "world projection + LoRA" in r.stderr
    from safetensors import safe_open
    with safe_open(str(tmp_path / "run" / "step-60" / "adapter.safetensors"), "pt") as f:   # LoRA: trainables only
        names = set(f.keys())
    assert {"world_projector.projection.0.weight", "world_projector.projection.2.weight"} <= names
    assert any("lora_" in n for n in names) and not any("vision_tower" in n for n in names)
    print(f"theworld nproc={nproc}: loss {first:.3f} -> {last:.3f} (x{last / first:.3f})")
    if profile:
        report = (tmp_path / "run" / "profile" / "report.md").read_text()
        assert "# Profile of steps 3-5" in report and "| forward |" in report and "aten::" in report
        trace = next((tmp_path / "run" / "profile").glob("trace-rank0-*.json"))
        ops = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
        image_ops = sorted(o for o in ops if any(w in o for w in ("conv", "pool", "upsample")))
        assert not image_ops, image_ops
        assert not any(w in report for w in ("conv", "pool"))


def test_projection_only_trains_only_the_projection(world_cache, gemma3, caplog, tmp_path):
    """TheWorld's setting (no LoRA): the LM is frozen, the vision tower is gone before the model
    reaches a device, the world projection alone trains and the logged fraction is its share; a
    TheWorld projection state dict is loaded to continue from."""
    import logging
    from safetensors.torch import save_file
    from train.models import build_model
    spec = world_cache
    with caplog.at_level(logging.INFO, logger="train"):
        m = build_model("theworld", {**KW, "lm": str(gemma3)}, spec)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {f"world_projector.projection.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
    share = (16 * 64 + 64 + 64 * 64 + 64) / sum(p.numel() for p in m.parameters())
    assert m.trainable_fraction() == pytest.approx(share)
    assert any("trainable fraction" in r.message and "world projection only" in r.message for r in caplog.records)
    assert m.lm.model.vision_tower is None and m.lm.model.multi_modal_projector is None
    assert [g["name"] for g in m.optimizer_groups(1e-3, 0.0)] == ["projection", "projection_no_decay"]
    theirs = {f"world_projector.projection.{k}": torch.full_like(v, 0.5)
              for k, v in m.world_projector.projection.state_dict().items()}
    save_file(theirs, str(tmp_path / "proj.safetensors"))
    m2 = build_model("theworld", {**KW, "lm": str(gemma3), "projection_checkpoint": str(tmp_path / "proj.safetensors"),
                                  "projection_architecture": "mlp"}, spec)
    assert all(bool((p == 0.5).all()) for p in m2.world_projector.parameters())


def test_verify_checks_bf16_bits_and_the_config_is_validated(world_cache, tmp_path):
    """A NaN bit pattern written into an image_features member: `shards verify --deep` names the sample
    and the field (the kind's check: no exponent of all ones). A bad image_features section is refused
    before any model is loaded, naming the option."""
    import shutil
    from precompute.config import load_config
    from precompute.validate import check_config
    from shards import read_index
    cache = tmp_path / "c"
    shutil.copytree(world_cache, cache)
    row = read_index(cache).to_pylist()[0]
    m = next(x for x in row["members"] if x["name"] == "image_features.npy")
    shard = cache / row["shard"]
    shard.chmod(0o644)
    with open(shard, "r+b") as f:
        f.seek(m["offset"] + 2 * 5)
        f.write(np.array([0x7FC0], np.uint16).tobytes())          # bfloat16 NaN
    v = subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(cache), "--deep", "--no_progress"],
                       cwd=ROOT, capture_output=True, text=True)
    assert v.returncode == 1 and row["key"] in v.stdout, v.stdout + v.stderr
    assert "image_features has 1 non-finite bfloat16 value" in v.stdout, v.stdout
    problems = dict(check_config(load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        "image_features={name: siglip, pretrained: x}"])))
    assert "image_features.name" in problems and "gemma3" in problems["image_features.name"]
    problems = dict(check_config(load_config(None, ["image_features={name: gemma3, dtype: fp8}"])))
    assert set(problems) >= {"image_features.pretrained", "image_features.dtype"}, problems


#: two-image LLaVA records: two different images each, in both orders, the second image in a later turn,
#: so image k taken from the wrong place (the other image of the sample) changes what lands at marker k
MULTI = [
    {"id": "two-a", "image": ["images/astronaut.png", "images/rocket.jpg"], "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "An astronaut."},
        {"from": "human", "value": "<image>\nAnd this one?"}, {"from": "gpt", "value": "A rocket."}]},
    {"id": "two-b", "image": ["images/rocket.jpg", "images/astronaut.png"], "conversations": [
        {"from": "human", "value": "<image>\n<image>\nCompare them."}, {"from": "gpt", "value": "Rocket, then astronaut."}]},
    {"id": "two-c", "image": ["images/coins.jpg", "images/chelsea.jpg"], "conversations": [
        {"from": "human", "value": "<image>\nCount."}, {"from": "gpt", "value": "Many coins."},
        {"from": "human", "value": "<image>\nAnd?"}, {"from": "gpt", "value": "A cat."}]},
]


@pytest.fixture(scope="module")
def multi_cache(real_mini, tiny_models, gemma3, tmp_path_factory) -> tuple[Path, dict]:
    """:data:`MULTI` (paths absolute) through configs/precompute-theworld.yaml: ``(cache, {id: record})``."""
    from precompute.config import load_config
    from precompute.job import run
    from precompute.validate import validate_config
    out = tmp_path_factory.mktemp("theworld-multi")
    recs = [dict(r, image=[str(real_mini / p) for p in r["image"]]) for r in MULTI]
    (out / "m.json").write_text(json.dumps(recs))
    cfg = validate_config(load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        f"image_encoder.pretrained={tiny_models / 'wan-tiny'}", f"text_tokenizer.pretrained={gemma3}",
        f"image_features.pretrained={gemma3}", f"image_size={IMAGE_SIZE}", "device=cpu", "num_workers=0",
        "allow_outside_root=true", *PRESET]))
    summary, _ = run(out / "m.json", out / "cache", cfg, progress=False)
    assert summary.kept == len(MULTI) and summary.rejected == 0, summary.reasons
    return out / "cache", {r["id"]: r for r in recs}


def test_multi_image_samples_end_to_end(multi_cache, gemma3, tiny_models):
    """Samples with two images, end to end: computed here independently for image k of each sample
    (Gemma 3's processor + ``get_image_features`` on the files, TheWorld's VAE preprocessing written
    out), the recipe's LM inputs hold image k's features at the k-th run of ``<image_soft_token>`` and
    the projection of image k's latent cells after the k-th ``<start_of_world>``; the cached ids are
    the processor's for the same text. Taking any image's tensors from the sample's other image fails."""
    from diffusers import AutoencoderKLWan
    from PIL import Image
    from transformers import Gemma3ForConditionalGeneration

    from loaders import Reads, ShardLoader, Workers
    from loaders.device import to_device
    from train.models import build_model

    cache, records = multi_cache
    proc = _processor(gemma3)
    gemma = Gemma3ForConditionalGeneration.from_pretrained(str(gemma3), dtype=torch.bfloat16).eval()
    vae = AutoencoderKLWan.from_pretrained(str(tiny_models / "wan-tiny"), torch_dtype=torch.bfloat16).eval()
    roles = {"human": "user", "gpt": "assistant"}
    want_ids, want_feats, want_cells = {}, {}, {}
    for key, rec in records.items():
        msgs = [{"role": roles[t["from"]], "content": t["value"].replace("<image>", "<start_of_image>")}
                for t in rec["conversations"]]
        text = proc.tokenizer.apply_chat_template(msgs, tokenize=False)
        text = "<bos>" + "<start_of_world><end_of_world>" * 2 + text[len("<bos>"):]
        images = [Image.open(p) for p in rec["image"]]
        out = proc(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
        want_ids[key] = out["input_ids"][0]
        with torch.no_grad():
            want_feats[key] = gemma.model.get_image_features(out["pixel_values"].to(torch.bfloat16)).pooler_output
            cells = []
            for im in images:   # TheWorld's cosmos_vae_encoder.py at this test's size
                x = im.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
                x = torch.from_numpy(np.array(x)).permute(2, 0, 1).float()[None].to(torch.bfloat16).unsqueeze(2)
                z = vae.encode(x).latent_dist.mode()[0, :, 0].float()                # (C, H, W)
                cells.append(z.flatten(1).T)                                         # (H*W, C) row-major
            want_cells[key] = cells
        assert want_feats[key].shape[0] == 2
        assert not torch.allclose(want_feats[key][0].float(), want_feats[key][1].float(), atol=1e-2)

    spec = Cache.open(cache)
    world_start, world_end = (spec.token_id(t) for t in spec.world_tokens)
    model = build_model("theworld", {**KW, "lm": str(gemma3)}, spec).eval()
    ld = ShardLoader(cache, len(MULTI), fields=model.fields, seed=0, workers=Workers(num_workers=0), reads=Reads(compact=False))
    batch = to_device(next(iter(ld)), "cpu")
    ld.close()
    assert sorted(batch["keys"]) == sorted(records)
    with torch.no_grad():
        merged, token_type = model.inputs(batch)
        embed = model.lm.get_input_embeddings()
        T = gemma.config.mm_tokens_per_image
        for b, key in enumerate(batch["keys"]):
            ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
            assert ids.tolist() == want_ids[key].tolist(), key
            row, types = merged.inputs_embeds[b], token_type[b].bool()
            soft_rows = row[types]                                                    # in order of position
            assert soft_rows.shape[0] == 2 * T
            sow = (ids == world_start).nonzero().flatten().tolist()
            assert len(sow) == 2
            shift = 0
            for k in range(2):
                torch.testing.assert_close(soft_rows[k * T:(k + 1) * T].float(), want_feats[key][k].float(),
                                           rtol=2 ** -7, atol=1e-3, msg=f"{key}: image {k}'s features")
                cells = want_cells[key][k]
                world = model.world_projector.projection(cells.to(row.dtype))
                start = sow[k] + shift + 1
                torch.testing.assert_close(row[start:start + len(cells)], world, rtol=1e-2, atol=2e-3,
                                           msg=f"{key}: image {k}'s world tokens")
                torch.testing.assert_close(row[start + len(cells)],
                                           embed(torch.tensor([world_end]))[0].to(row.dtype))
                shift += len(cells)


def test_pan_and_scan_is_refused_not_paired_by_position(gemma3, tiny_models, real_mini, tmp_path):
    """Gemma 3's pan-and-scan makes ``num_crops`` extra pixel rows per image (the processor's own counts):
    a checkpoint with it on is refused before any image is encoded, naming the option; and an encoder
    whose processor makes crops anyway refuses the call instead of returning more feature rows than
    images (which the producer would pair with the sample's images by position)."""
    import shutil
    from PIL import Image
    from precompute.config import load_config
    from precompute.job import run
    from precompute.producers.image_features import Gemma3VisionEncoder

    wide = np.asarray(Image.open(real_mini / "images" / "rocket.jpg").convert("RGB").resize((600, 150)))
    square = np.asarray(Image.open(real_mini / "images" / "astronaut.png").convert("RGB"))
    want_crops = Gemma3VisionEncoder(str(gemma3)).processor.image_processor(
        [Image.fromarray(wide), Image.fromarray(square)], do_pan_and_scan=True, pan_and_scan_min_crop_size=32,
        pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2, return_tensors="pt")["num_crops"]
    assert want_crops.tolist()[0] > 0 and want_crops.tolist()[1] == 0     # the wide image gets crops

    enc = Gemma3VisionEncoder(str(gemma3))
    assert len(enc.encode([wide, square])) == 2
    enc.processor.image_processor.do_pan_and_scan = True
    ip = enc.processor.image_processor
    ip.pan_and_scan_min_crop_size, ip.pan_and_scan_max_num_crops, ip.pan_and_scan_min_ratio_to_activate = 32, 4, 1.2
    with pytest.raises(ValueError, match=r"num_crops \[%d, 0\]" % want_crops.tolist()[0]):
        enc.encode([wide, square])

    pas = tmp_path / "gemma3-pan-and-scan"
    shutil.copytree(gemma3, pas)
    pc = json.loads((pas / "processor_config.json").read_text())
    pc["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=32, pan_and_scan_max_num_crops=4,
                                 pan_and_scan_min_ratio_to_activate=1.2)
    (pas / "processor_config.json").write_text(json.dumps(pc))
    cfg = load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        f"image_encoder.pretrained={tiny_models / 'wan-tiny'}", f"text_tokenizer.pretrained={gemma3}",
        f"image_features.pretrained={pas}", f"image_size={IMAGE_SIZE}", "device=cpu", "num_workers=0"])
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        run(real_mini / MANIFEST, tmp_path / "cache", cfg, progress=False)
    assert not (tmp_path / "cache" / "index.parquet").exists()


def _theworld_collate(proc, record: dict, image_path: Path) -> list[int]:
    """TheWorld's own rules, written out (``python/theworld/data.py`` ``theworld_collate_fn``, multi-turn
    branch, and ``modeling/theworld.py`` ``_inject_world_tokens``): the first user message's content is
    ``[image item, its text with <image> removed and stripped]``, later turns one text item each, through
    the processor's ``apply_chat_template(tokenize=True)``; then ``<start_of_world><end_of_world>`` after
    BOS. TheWorld's forward labels every one of these ids (-100 only on the world embeddings)."""
    from PIL import Image
    roles = {"human": "user", "gpt": "assistant"}
    msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]
    full = [{"role": "user", "content": [{"type": "image", "image": Image.open(image_path)},
                                         {"type": "text", "text": msgs[0]["content"].replace("<image>", "").strip()}]}]
    full += [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in msgs[1:]]
    out = proc.apply_chat_template(full, tokenize=True, add_generation_prompt=False, return_dict=True,
                                   return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    sow, eow = proc.tokenizer.convert_tokens_to_ids(["<start_of_world>", "<end_of_world>"])
    return [ids[0], sow, eow] + ids[1:]


@pytest.mark.parametrize("policy", ["all_but_world", "answers"])
def test_theworld_preset_is_theworlds_collate_token_for_token(policy, real_mini, tiny_models, gemma3, tmp_path):
    """``chat_template: theworld`` gives TheWorld's input_ids id for id (image as its own content item: no
    extra newline after ``<end_of_image>``, whatever side of the text the LLaVA ``<image>`` was on);
    ``label_policy: all_but_world`` labels all of them as TheWorld's forward does, ``answers`` only the
    answers (each labelled run = the stripped answer + ``<end_of_turn>``)."""
    from precompute.config import load_config
    from precompute.job import run
    from test_chat import labelled_runs
    recs = json.loads((real_mini / MANIFEST).read_text())[:4]
    recs.append({"id": "image-last", "image": recs[0]["image"], "conversations": [
        {"from": "human", "value": "  Describe it.\n<image>"}, {"from": "gpt", "value": " An astronaut. "}]})
    recs = [dict(r, image=str(real_mini / r["image"])) for r in recs]
    (tmp_path / "m.json").write_text(json.dumps(recs))
    cfg = load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        f"image_encoder.pretrained={tiny_models / 'wan-tiny'}", f"text_tokenizer.pretrained={gemma3}",
        f"image_features.pretrained={gemma3}", f"image_size={IMAGE_SIZE}", "device=cpu", "num_workers=0",
        "allow_outside_root=true", "chat_template=theworld", f"label_policy={policy}"])
    summary, man = run(tmp_path / "m.json", tmp_path / "cache", cfg, progress=False)
    assert summary.kept == len(recs), summary.reasons
    assert man["encoders"]["preprocessing"]["chat_template"] == "theworld"
    proc = _processor(gemma3)
    end = proc.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    got = _samples(tmp_path / "cache")
    for rec in recs:
        s = got[rec["id"]]
        want = _theworld_collate(proc, rec, Path(rec["image"]))
        assert s["input_ids"].tolist() == want, rec["id"]
        if policy == "all_but_world":
            assert s["labels"].tolist() == want
        else:
            answers = [t["value"].strip() for t in rec["conversations"] if t["from"] == "gpt"]
            runs = labelled_runs(s["input_ids"], s["labels"])
            assert [proc.tokenizer.decode(r[:-1]) for r in runs] == answers and all(r[-1] == end for r in runs)
    if policy == "all_but_world":   # the recipe's labels: TheWorld's _forward_with_world, written out
        from loaders import Reads, ShardLoader, Workers
        from loaders.device import to_device
        from train.models import build_model
        spec = Cache.open(tmp_path / "cache")
        world_start, world_end = (spec.token_id(t) for t in spec.world_tokens)
        model = build_model("theworld", {"lm": str(gemma3), "image_size": IMAGE_SIZE, "vae": KW["vae"]},
                            spec).eval()   # TheWorld's text
        ld = ShardLoader(tmp_path / "cache", len(recs), fields=model.fields, seed=0, workers=Workers(num_workers=0), reads=Reads(compact=False))
        batch = to_device(next(iter(ld)), "cpu")
        ld.close()
        with torch.no_grad():
            merged, _ = model.inputs(batch)
        n_world = (IMAGE_SIZE // 8) ** 2
        for b, key in enumerate(batch["keys"]):
            ids = batch["input_ids"][b][batch["attention_mask"][b].bool()].tolist()
            sow, eow = ids.index(world_start), ids.index(world_end)
            want = ids[:sow + 1] + [-100] * n_world + ids[eow:]
            assert merged.labels[b][merged.attention_mask[b]].tolist() == want, key


def test_vocabulary_theworlds_resize_and_ours_give_the_markers_the_same_rows(world_cache, gemma3):
    """TheWorld adds its two markers to Gemma's tokenizer and calls ``resize_token_embeddings(len(tokenizer))``
    (262,145 + 2 = 262,147 for gemma-3-4b-it, whose embedding has 262,208 rows): a shrink, so no row is
    initialised and the markers get the checkpoint's own padding rows. The recipe never shrinks (the cache's
    vocab_size is below the model's): the markers get the very same rows; what differs is only the width of the
    output softmax (the unused rows stay classes). The tiny Gemma 3 mirrors the shape: 300 tokens, 320 rows."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration
    from train.models import build_model
    spec = Cache.open(world_cache)
    world_start, world_end = (spec.token_id(t) for t in spec.world_tokens)
    ours = build_model("theworld", {**KW, "lm": str(gemma3)}, spec)
    tok = AutoTokenizer.from_pretrained(str(gemma3))
    theirs = Gemma3ForConditionalGeneration.from_pretrained(str(gemma3))
    rows = theirs.get_input_embeddings().weight.shape[0]
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_world>", "<end_of_world>"]})
    ids = tok.convert_tokens_to_ids(["<start_of_world>", "<end_of_world>"])
    assert ids == [world_start, world_end] and len(tok) == spec.vocab_size < rows
    before = theirs.get_input_embeddings().weight[ids].detach().clone()
    theirs.resize_token_embeddings(len(tok))
    assert theirs.get_input_embeddings().weight.shape[0] == len(tok)
    assert ours.lm.get_input_embeddings().weight.shape[0] == rows
    torch.testing.assert_close(theirs.get_input_embeddings().weight[ids], before, rtol=0, atol=0)
    torch.testing.assert_close(ours.lm.get_input_embeddings().weight[ids], before, rtol=0, atol=0)


def _theworld_projection(architecture: str, z_dim: int, dim: int) -> torch.nn.Module:
    """TheWorld's ``WorldProjector._build_projection`` written out (``world_projector.py``)."""
    nn = torch.nn
    if architecture == "mlp":
        return nn.Sequential(nn.Linear(z_dim, dim), nn.GELU(), nn.Linear(dim, dim), nn.GELU())
    if architecture == "mlp_no_final_gelu":
        return nn.Sequential(nn.Linear(z_dim, dim), nn.GELU(), nn.Linear(dim, dim))
    return nn.Linear(z_dim, dim)


def test_projection_checkpoints_of_every_theworld_variant(world_cache, gemma3, tmp_path, caplog):
    """TheWorld's checkpoints (``save_pretrained``: config.json with ``projection_architecture`` + the
    trainable weights under ``world_projector.projection.*``) of each architecture load into a projection
    that computes what TheWorld's module computes; a two-layer MLP that nothing names, a layout or shapes
    of no variant (channel mode), and an architecture contradicting the checkpoint are refused naming what
    was found; LM weights in the checkpoint are reported, not loaded silently."""
    import logging
    from safetensors.torch import save_file
    from train.models import build_model
    spec = Cache.open(world_cache)
    world_start, world_end = (spec.token_id(t) for t in spec.world_tokens)
    z, dim = 16, 64
    torch.manual_seed(0)
    cells = torch.randn(5, z)
    for arch in ("mlp", "mlp_no_final_gelu", "linear"):
        theirs = _theworld_projection(arch, z, dim)
        d = tmp_path / arch
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "theworld", "projection_architecture": arch}))
        state = {f"world_projector.projection.{k}": v.detach().clone() for k, v in theirs.state_dict().items()}
        save_file(state | {"model.language_model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)},
                  str(d / "model.safetensors"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="train"):
            m = build_model("theworld", {**KW, "lm": str(gemma3), "projection_checkpoint": str(d / "model.safetensors")},
                            spec)
        with torch.no_grad():
            torch.testing.assert_close(m.world_projector(cells), theirs(cells), msg=arch)
        assert any("model.language_model.layers.0.mlp.up_proj.weight" in r.message and "NOT loaded" in r.message
                   for r in caplog.records), arch
    # no config.json: an MLP's architecture must be named; a linear one is recognised by its keys
    bare = tmp_path / "bare"
    bare.mkdir()
    for arch in ("mlp_no_final_gelu", "linear"):
        theirs = _theworld_projection(arch, z, dim)
        save_file({f"world_projector.projection.{k}": v for k, v in theirs.state_dict().items()},
                  str(bare / f"{arch}.safetensors"))
    with pytest.raises(ValueError, match="mlp or mlp_no_final_gelu .* set model.kwargs.projection_architecture"):
        build_model("theworld", {**KW, "lm": str(gemma3), "projection_checkpoint": str(bare / "mlp_no_final_gelu.safetensors")},
                    spec)
    with pytest.raises(ValueError, match="holds one Linear .* projection_architecture is mlp"):
        build_model("theworld", {**KW, "lm": str(gemma3), "projection_checkpoint": str(bare / "linear.safetensors"),
                                 "projection_architecture": "mlp"}, spec)
    with pytest.raises(ValueError, match="projection_architecture is mlp, but .*config.json says projection_archi"):
        build_model("theworld", {**KW, "lm": str(gemma3), "projection_checkpoint": str(tmp_path / "linear" / "model.safetensors"),
                                 "projection_architecture": "mlp"}, spec)
    channel = _theworld_projection("mlp", 64, dim)           # channel mode: one token per channel, input H*W = 64
    save_file({f"world_projector.projection.{k}": v for k, v in channel.state_dict().items()},
              str(bare / "channel.safetensors"))
    with pytest.raises(ValueError, match="channel mode"):
        build_model("theworld", {**KW, "lm": str(gemma3), "projection_checkpoint": str(bare / "channel.safetensors"),
                                 "projection_architecture": "mlp"}, spec)
