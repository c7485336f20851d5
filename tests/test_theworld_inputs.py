"""Stage one for TheWorld / Gemma 3: the ``theworld`` preset's latents are TheWorld's own, and a
Gemma 3 chat template trains every answer whatever its whitespace.

TheWorld's preprocessing (``kasohrab/theworld``, ``python/theworld/modeling/cosmos_vae_encoder.py``)
is written out here independently (Pillow, torch, diffusers), never through the code under test.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from precompute.config import load_config
from precompute.job import run
from shards import ShardReader
from tools.testing.chat_templates import make_chat_tokenizer
from test_chat import labelled_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-tokenizer")
    make_chat_tokenizer("gemma3").save_pretrained(str(path))
    return path


def samples(cache: Path) -> dict[str, dict]:
    r = ShardReader(cache)
    return {k: r.get(i) for i, k in enumerate(r.keys)}


def test_whitespace_padded_answers_through_gemma3_are_all_trained(real_mini, tiny_config, gemma_dir, tmp_path):
    """Done-when of issue 21: every kept sample has trained tokens, each answer's labelled span
    decodes to the stripped answer (+ Gemma's <end_of_turn>); rows without assistant content are
    rejected no_targets and counted in the job summary."""
    answers = {"rocket": [" A rocket on a launch pad.\n", "  Daytime. "],
               "coffee": ["\tA cup of coffee.\n\n"],
               "chelsea": ["A cat.  ", "\nOrange and white."]}
    recs = []
    for name, ans in answers.items():
        turns = [{"from": "human", "value": "<image>\n What is shown? "}, {"from": "gpt", "value": ans[0]}]
        if len(ans) > 1:
            turns += [{"from": "human", "value": "And? "}, {"from": "gpt", "value": ans[1]}]
        recs.append({"id": name, "image": str(next((real_mini / "images").glob(name + ".*"))), "conversations": turns})
    recs.append({"id": "blank", "image": str(real_mini / "images" / "coins.jpg"),
                 "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "  \n "}]})
    recs.append({"id": "unanswered", "image": str(real_mini / "images" / "camera.jpg"),
                 "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}]})
    manifest = tmp_path / "padded.json"
    manifest.write_text(json.dumps(recs))
    cfg = load_config(None, [f"image_encoder.pretrained={tiny_config.image_encoder['pretrained']}",
                             "audio_tokenizer=null", f"text_tokenizer={{name: hf, pretrained: {gemma_dir}}}",
                             "image_token=<start_of_image>", "image_size=64", "num_workers=0", "device=cpu",
                             "allow_outside_root=true"])
    summary, manifest_json = run(manifest, tmp_path / "cache", cfg, progress=False)
    assert (summary.kept, summary.rejected, summary.reasons) == (3, 2, {"no_targets": 2})
    rejects = pq.read_table(tmp_path / "cache" / "rejects.parquet").to_pylist()
    assert {r["key"]: r["reason"] for r in rejects} == {"blank": "no_targets", "unanswered": "no_targets"}
    assert manifest_json["counts"]["rejects_by_reason"] == {"no_targets": 2}
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gemma_dir))
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    for key, s in samples(tmp_path / "cache").items():
        runs = labelled_runs(s["input_ids"], s["labels"])
        assert [r[-1] for r in runs] == [end] * len(answers[key])
        assert [tok.decode(r[:-1]) for r in runs] == [a.strip() for a in answers[key]]
        assert (s["labels"][s["input_ids"] == tok.convert_tokens_to_ids("<start_of_image>")] == -100).all()
    assert manifest_json["text"]["placeholders"]["image"] == "<start_of_image>"
    assert "added_tokens" not in manifest_json["text"]          # Gemma has its image token: nothing added


def test_theworld_preset_latents_are_theworlds_own(real_mini, tiny_models, gemma_dir, tmp_path):
    """Done-when of issue 21: TheWorld's CosmosVAEEncoder written out here (Pillow bilinear stretch
    to 512, to_tensor(img) * 255, bfloat16, mode()) through the same tiny VAE equals the cached
    latents of configs/precompute-theworld.yaml within bfloat16 rounding; the manifest says how
    they were made; the world markers follow BOS and were added to Gemma's tokenizer."""
    from diffusers import AutoencoderKLWan
    image = real_mini / "images" / "rocket.jpg"                  # 640 x 427: the stretch changes its aspect
    rec = {"id": "rocket", "image": str(image), "conversations": [
        {"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "A rocket."}]}
    manifest = tmp_path / "one.json"
    manifest.write_text(json.dumps([rec]))
    cfg = load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        f"image_encoder.pretrained={tiny_models / 'wan-tiny'}", f"text_tokenizer.pretrained={gemma_dir}",
        "image_features=null", "num_workers=0", "device=cpu", "allow_outside_root=true"])
    summary, m = run(manifest, tmp_path / "cache", cfg, progress=False)
    assert summary.kept == 1, summary.reasons
    s = samples(tmp_path / "cache")["rocket"]

    # TheWorld, python/theworld/modeling/cosmos_vae_encoder.py, step by step
    img = Image.open(image).convert("RGB").resize((512, 512), Image.Resampling.BILINEAR)
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0 * 255.0   # TF.to_tensor(img) * 255
    x = x[None].to(torch.bfloat16).unsqueeze(2)                                      # (1, 3, 1, 512, 512)
    vae = AutoencoderKLWan.from_pretrained(str(tiny_models / "wan-tiny"), torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()[0, :, 0].float().numpy()               # (16, 64, 64)
    got = s["latents"]
    assert got.shape == (16, 1, 64, 64) and got.dtype == np.float16
    # bfloat16 keeps 8 significant bits: equal within one bf16 step of each value
    np.testing.assert_allclose(got[:, 0].astype(np.float32), z, rtol=2 ** -7, atol=1e-3)
    assert np.abs(z).max() > 0.05                                # not a trivially small comparison

    lat = m["latents"]
    assert {k: lat[k] for k in ("resize", "size", "interpolation", "rgb", "input_range", "dtype", "normalized")} == {
        "resize": "stretch", "size": 512, "interpolation": "bilinear", "rgb": "convert", "input_range": [0.0, 255.0],
        "dtype": "bfloat16", "normalized": False}
    assert lat["latents_mean"] == list(vae.config.latents_mean) and lat["latents_std"] == list(vae.config.latents_std)
    pre = m["encoders"]["preprocessing"]
    assert (pre["image_pixel_range"], pre["image_resize"], pre["encoder_dtype"]) == ("0..255", "stretch", "bfloat16")

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gemma_dir))
    n = len(tok)
    text = m["text"]
    assert text["added_tokens"] == {"<start_of_world>": n, "<end_of_world>": n + 1}
    assert (text["vocab_size"], text["base_vocab_size"]) == (n + 2, n)
    assert text["world_tokens"] == ["<start_of_world>", "<end_of_world>"]
    assert s["input_ids"][:4].tolist() == [tok.bos_token_id, n, n + 1, tok.convert_tokens_to_ids("<start_of_turn>")]
    assert (s["labels"] == s["input_ids"]).all()      # TheWorld's objective (label_policy: all_but_world)
