"""The ``--model.name tts`` / ``--model.name vlm`` recipes (train/recipes) on a tiny real ``LlamaForCausalLM``.

Batches are built here by hand following the conversation contract (input_ids with placeholder
tokens, labels, codes, audio_segments, latents); expected values (delay pattern, sequence
layout, losses, patch embeddings) are computed independently with plain loops.
"""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from shards import Cache, ContractMismatch
from train.models import apply_lora, build_model
from train.recipes.tts import TTSModel, build_delay_pattern, revert_delay_pattern
from train.recipes.vlm import VLMModel

Q, CB = 3, 16                      # codebooks, codebook size (stream BOS = 16, EOS = 17)
BOS, EOS = CB, CB + 1
# the byte tokenizer's special ids (precompute.chat.SPECIAL_TOKENS after 259 byte ids)
PAD, BOT, SH, EH, EOT = 0, 259, 260, 261, 262
A_BOS, A_IN, A_EOS, AO_BOS, A_OUT, IMG = 264, 265, 266, 267, 268, 269
VOCAB = 272                        # the cache's vocab: > the LM's 264 rows, so the recipe resizes
C_LAT, P = 4, 2                    # latent channels, patch size
SPEC = dict(n_codebooks=Q, codebook_size=CB, vocab_size=VOCAB, pad_id=PAD, audio_in_token_id=A_IN,
            audio_out_token_id=A_OUT, audio_out_bos_token_id=AO_BOS)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # initializer_range 0.2 (not 0.02): a random LM whose head can be confident, like a trained one;
    # at 0.02 the frozen head bounds |logits| < ~0.7 and no projection can overfit a caption
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=264, max_position_embeddings=512, initializer_range=0.2)
    path = tmp_path_factory.mktemp("lm") / "llama-tiny"
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    from tools.testing.text import make_tokenizer
    make_tokenizer("tiny").save_pretrained(str(path))   # an LM ships its tokenizer (the contract compares it)
    return str(path)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tts(lm_dir, **kw) -> TTSModel:
    torch.manual_seed(0)
    return TTSModel(lm=lm_dir, **{**SPEC, **kw})


def vlm(lm_dir, **kw) -> VLMModel:
    torch.manual_seed(0)
    return VLMModel(lm=lm_dir, latent_channels=C_LAT, vocab_size=VOCAB, pad_id=PAD, image_token_id=IMG, **kw)


# ---- synthetic batches (the contract, by hand) ------------------------------------------------------

def render(parts, seed=0):
    """parts: ("text", ids, trained) | ("in", frames) | ("out", frames, trained) -> one sample."""
    g = torch.Generator().manual_seed(seed)
    ids, labels, rows, codes = [], [], [], []
    start = 0
    for part in parts:
        if part[0] == "text":
            ids += part[1]
            labels += part[1] if part[2] else [-100] * len(part[1])
            continue
        frames = part[1]
        trained = part[0] == "out" and part[2]
        toks = [AO_BOS, A_OUT, A_EOS] if part[0] == "out" else [A_BOS, A_IN, A_EOS]
        ids += toks
        labels += toks if trained else [-100] * 3    # Higgs' prepare_chatml_sample: the placeholder too
        rows.append([len(rows), 0, int(part[0] == "out"), start, frames, -1])
        codes.append(torch.randint(0, CB, (Q, frames), generator=g))
        start += frames
    return {"ids": ids, "labels": labels, "rows": rows,
            "codes": torch.cat(codes, 1) if codes else torch.zeros((Q, 0), dtype=torch.long)}


def collate(samples):
    B = len(samples)
    L = max(len(s["ids"]) for s in samples)
    Fr = max(s["codes"].shape[1] for s in samples)
    S = max(max(len(s["rows"]) for s in samples), 1)
    batch = {"input_ids": torch.full((B, L), PAD), "labels": torch.full((B, L), -100),
             "attention_mask": torch.zeros((B, L), dtype=torch.bool), "codes": torch.full((B, Q, Fr), -100),
             "audio_segments": torch.full((B, S, 6), -1), "audio_segments_count": torch.zeros(B, dtype=torch.long)}
    for b, s in enumerate(samples):
        n = len(s["ids"])
        batch["input_ids"][b, :n] = torch.tensor(s["ids"])
        batch["labels"][b, :n] = torch.tensor(s["labels"])
        batch["attention_mask"][b, :n] = True
        batch["codes"][b, :, :s["codes"].shape[1]] = s["codes"]
        if s["rows"]:
            batch["audio_segments"][b, :len(s["rows"])] = torch.tensor(s["rows"])
        batch["audio_segments_count"][b] = len(s["rows"])
    return batch


def delay_by_hand(codes):
    """Loops, no tensor tricks: row q = [BOS]*q + [BOS, codes_q, EOS] + [EOS]*(Q-1-q); labels the same
    with -100 for every BOS and for the trailing fill."""
    Qn, n = codes.shape
    ids, labels = [], []
    for q in range(Qn):
        stream = [BOS] + codes[q].tolist() + [EOS]
        lab = [-100] + codes[q].tolist() + [EOS]
        ids.append([BOS] * q + stream + [EOS] * (Qn - 1 - q))
        labels.append([-100] * q + lab + [-100] * (Qn - 1 - q))
    return torch.tensor(ids), torch.tensor(labels)


def layout_by_hand(sample):
    """Expanded length, per-position labels and the start of each audio run, walking the tokens."""
    pos, labels, starts, k = 0, [], [], 0
    for tok, lab in zip(sample["ids"], sample["labels"]):
        if tok in (A_IN, A_OUT):
            M = sample["rows"][k][4] + Q + 1
            starts.append(pos)
            labels += [-100] * M
            pos += M
            k += 1
        else:
            labels.append(lab)
            pos += 1
    return pos, labels, starts


TTS_SAMPLE = [("text", [BOT, SH, 117, EH, 10, 11], False), ("in", 3), ("text", [EOT, SH, 97, EH], False),
              ("text", [40, 41], True), ("out", 4, True), ("text", [EOT], True)]


# ---- TTS ------------------------------------------------------------------------------------------

def test_delay_pattern_matches_hand_written_block(lm_dir):
    codes = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    _ = -100
    want_ids = torch.tensor([[16, 1, 2, 3, 4, 17, 17, 17],
                             [16, 16, 5, 6, 7, 8, 17, 17],
                             [16, 16, 16, 9, 10, 11, 12, 17]])
    want_labels = torch.tensor([[_, 1, 2, 3, 4, 17, _, _],
                                [_, _, 5, 6, 7, 8, 17, _],
                                [_, _, _, 9, 10, 11, 12, 17]])
    ids, labels = build_delay_pattern(codes, BOS, EOS)
    assert torch.equal(ids, want_ids) and torch.equal(labels, want_labels)
    assert torch.equal(revert_delay_pattern(ids), torch.cat([torch.full((3, 1), 16), codes, torch.full((3, 1), 17)], 1))
    # the model path: the same block as the second audio item of a sample, behind an input item
    s = render([("text", [BOT, 5], False), ("in", 2), ("text", [6], False), ("out", 4, True), ("text", [EOT], True)])
    s["codes"][:, 2:] = codes
    m = tts(lm_dir).eval()
    with torch.no_grad():
        merged, audio = m.merge(collate([s]))
    assert torch.equal(audio["ids"][1, :, :8], want_ids) and torch.equal(audio["labels"][1, :, :8], want_labels)
    # frame j of the run = sum over codebooks of that codebook's embedding of id[q, j]
    start = layout_by_hand(s)[2][1]
    table = m.audio_embed.weight.view(Q, CB + 2, -1)
    want = torch.stack([sum(table[q, want_ids[q, j]] for q in range(Q)) for j in range(8)])
    assert torch.allclose(merged.inputs_embeds[0, start:start + 8], want, atol=1e-6)


def test_expanded_sequence_layout(lm_dir):
    samples = [render(TTS_SAMPLE, seed=1),
               render([("text", [BOT, SH, 9, EH], False), ("out", 6, True), ("text", [EOT], True)], seed=2)]
    batch = collate(samples)
    m = tts(lm_dir).eval()
    with torch.no_grad():
        merged, _ = m.merge(batch)
    emb = m.lm.get_input_embeddings().weight
    for b, s in enumerate(samples):
        L, n_ph = len(s["ids"]), len(s["rows"])
        expected = L - n_ph + sum(r[4] + 2 + Q - 1 for r in s["rows"])
        length, labels, starts = layout_by_hand(s)
        assert length == expected == int(merged.attention_mask[b].sum())
        assert merged.labels[b, :length].tolist() == labels
        # the token after each placeholder (<|audio_eos|>) follows its run directly
        for k, st in enumerate(starts):
            assert torch.equal(merged.inputs_embeds[b, st + s["rows"][k][4] + Q + 1], emb[A_EOS])
    assert merged.inputs_embeds.shape[1] == max(int(merged.attention_mask[b].sum()) for b in range(2))


def test_losses_match_an_independent_computation(lm_dir):
    s = render(TTS_SAMPLE, seed=3)
    m = tts(lm_dir).eval()
    seen = []
    hook = m.lm.model.register_forward_hook(lambda mod, inp, out: seen.append(out.last_hidden_state))
    with torch.no_grad():
        out = m(collate([s]))
    hook.remove()
    h = seen[0][0]
    _, labels, starts = layout_by_hand(s)
    head = m.lm.get_output_embeddings()
    text = [F.cross_entropy(head(h[t]), torch.tensor(labels[t + 1]))
            for t in range(len(labels) - 1) if labels[t + 1] != -100]
    assert len(text) == 5                    # 40 41 <|audio_out_bos|> <|audio_eos|> <|eot_id|>
    assert math.isclose(out["text_loss"].item(), torch.stack(text).mean().item(), rel_tol=1e-5)
    # audio: only item 1 (output, trained); frame j predicts the delayed labels of frame j + 1
    frames = s["rows"][1][4]
    _, lab = delay_by_hand(s["codes"][:, s["rows"][1][3]:s["rows"][1][3] + frames])
    terms = [F.cross_entropy(m.audio_heads[q](h[starts[1] + j]), lab[q, j + 1])
             for j in range(frames + Q) for q in range(Q) if lab[q, j + 1] != -100]
    assert len(terms) == Q * (frames + 1)                  # n codes + one EOS per codebook
    assert math.isclose(out["audio_loss"].item(), torch.stack(terms).mean().item(), rel_tol=1e-5)
    assert math.isclose(out["loss"].item(), out["text_loss"].item() + out["audio_loss"].item(), rel_tol=1e-6)


def test_audio_loss_counts_trained_output_items_only(lm_dir):
    parts = [("text", [BOT, 7], False), ("out", 3, False), ("text", [8], True), ("out", 4, True),
             ("text", [EOT, 9], False), ("in", 3), ("out", 2, False), ("text", [EOT], False)]
    s = render(parts, seed=4)
    m = tts(lm_dir).eval()

    def audio_loss(sample):
        with torch.no_grad():
            return m(collate([sample]))["audio_loss"].item()

    base = audio_loss(s)
    later = {k: v.clone() if torch.is_tensor(v) else list(v) for k, v in s.items()}
    r_in = s["rows"][2]                                    # after the trained item: context cannot matter
    later["codes"][:, r_in[3]:] = (later["codes"][:, r_in[3]:] + 5) % CB
    assert audio_loss(later) == pytest.approx(base, abs=1e-6)
    trained = {**s, "codes": s["codes"].clone()}
    r = s["rows"][1]
    trained["codes"][:, r[3] + 1] = (trained["codes"][:, r[3] + 1] + 5) % CB
    assert abs(audio_loss(trained) - base) > 1e-4
    # Higgs' rule: the last item becomes a target when its own <|AUDIO_OUT|> placeholder is labelled ...
    at = [i for i, t in enumerate(s["ids"]) if t == A_OUT][2]
    own = {**s, "labels": list(s["labels"])}
    own["labels"][at] = A_OUT
    assert abs(audio_loss(own) - base) > 1e-4
    # ... and only then: a labelled <|audio_out_bos|> before it does not make it one (the
    # pre-release convention of caches made before the placeholder carried the label is not read)
    bos_only = {**s, "labels": list(s["labels"])}
    bos_only["labels"][at - 1] = AO_BOS
    assert audio_loss(bos_only) == pytest.approx(base, abs=1e-6)
    # a trained item with neither label is no target
    neither = {**s, "labels": list(s["labels"])}
    first_out = [i for i, t in enumerate(s["ids"]) if t == A_OUT][1]
    neither["labels"][first_out] = neither["labels"][first_out - 1] = -100
    assert abs(audio_loss(neither) - base) > 1e-4


def test_per_sample_normalisation_and_padding(lm_dir):
    a = render(TTS_SAMPLE, seed=5)
    b = render([("text", [BOT, 3], False), ("out", 9, True), ("text", [EOT], True)], seed=6)
    m = tts(lm_dir).eval()
    with torch.no_grad():
        la, lb, lab = m(collate([a])), m(collate([b])), m(collate([a, b]))
    for k in ("text_loss", "audio_loss", "loss"):
        assert lab[k].item() == pytest.approx((la[k].item() + lb[k].item()) / 2, rel=1e-5)


def test_every_audio_parameter_gets_a_gradient_without_audio(lm_dir):
    m = tts(lm_dir)
    s = render([("text", [BOT, SH, 5, EH], False), ("text", [6, EOT], True)])
    m(collate([s]))["loss"].backward()
    assert [n for n, p in m.named_parameters() if p.grad is None] == []   # DDP: no unused parameters


def test_tts_lora_trains_adapters_and_audio_modules_only(lm_dir):
    m = tts(lm_dir, lora={"r": 2, "alpha": 4})
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable)
    assert all("lora_" in n or n.startswith(("audio_embed.", "audio_heads.")) for n in trainable)
    assert {n for n in trainable if n.startswith("audio")} == \
        {n for n, _ in m.named_parameters() if n.startswith("audio")}
    lora_mods = {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in trainable if "lora_" in n}
    assert lora_mods == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # --lora (train.models.apply_lora) with the reference defaults: same options -> nothing more
    from train.spec import model_spec
    before = sum(p.numel() for p in m.parameters())
    assert apply_lora(m, 2, 4, 0.0, ("qkv", "proj", "fc1", "fc2"), spec=model_spec("tts")) is m
    assert sum(p.numel() for p in m.parameters()) == before
    with pytest.raises(ValueError, match="already applied"):
        apply_lora(m, 8, 16, 0.0, ("qkv", "proj", "fc1", "fc2"), spec=model_spec("tts"))
    m(collate([render(TTS_SAMPLE)]))["loss"].backward()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


# ---- VLM ------------------------------------------------------------------------------------------

def vlm_batch(seed=0):
    """Two samples: one image 6x4 / two images 4x6 and 2x2 (zero-padded to 6x6, latents_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = [[BOT, SH, 5, IMG, 6, EH, 20, 21, 22, EOT], [BOT, IMG, 7, IMG, EH, 30, 31, EOT]]
    trained = [(6, 10), (5, 8)]
    sizes = [[(6, 4)], [(4, 6), (2, 2)]]
    B, L = 2, 10
    batch = {"input_ids": torch.full((B, L), PAD), "labels": torch.full((B, L), -100),
             "attention_mask": torch.zeros((B, L), dtype=torch.bool),
             "latents": torch.zeros((B, C_LAT, 2, 6, 6)), "latents_mask": torch.zeros((B, 2, 6, 6), dtype=torch.bool)}
    for b in range(B):
        n = len(ids[b])
        batch["input_ids"][b, :n] = torch.tensor(ids[b])
        batch["attention_mask"][b, :n] = True
        a, e = trained[b]
        batch["labels"][b, a:e] = torch.tensor(ids[b][a:e])
        for k, (h, w) in enumerate(sizes[b]):
            batch["latents"][b, :, k, :h, :w] = torch.randn((C_LAT, h, w), generator=g)
            batch["latents_mask"][b, k, :h, :w] = True
    return batch, sizes


def test_vlm_image_embeddings_land_at_image_positions(lm_dir):
    m = vlm(lm_dir).eval()
    batch, sizes = vlm_batch()
    with torch.no_grad():
        merged = m.merge(batch)
    emb = m.lm.get_input_embeddings().weight
    for b in range(2):
        pos, k = 0, 0
        for tok in batch["input_ids"][b][batch["attention_mask"][b]].tolist():
            if tok != IMG:
                assert torch.equal(merged.inputs_embeds[b, pos], emb[tok])
                pos += 1
                continue
            h, w = sizes[b][k]
            for i in range(h // P):                       # row-major p x p patches, features (C, p, p)
                for j in range(w // P):
                    x = batch["latents"][b, :, k, i * P:(i + 1) * P, j * P:(j + 1) * P].reshape(-1)
                    with torch.no_grad():
                        assert torch.allclose(merged.inputs_embeds[b, pos], m.projector(x), atol=1e-6)
                    pos += 1
            k += 1
        assert pos == int(merged.attention_mask[b].sum())    # padding patches dropped
        assert merged.labels[b, pos - 3:pos].tolist() == batch["labels"][b][batch["labels"][b] != -100][-3:].tolist()


def test_vlm_frozen_lm_trains_projection_only_and_logs_it(lm_dir, caplog, monkeypatch):
    # transformers' records reach caplog only through propagation, and its warning_once fires once per
    # process: both set here, so the result does not depend on which test ran before on this worker
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="train"):
        m = vlm(lm_dir)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("projector.") for n in trainable)
    frac = sum(p.numel() for p in m.parameters() if p.requires_grad) / sum(p.numel() for p in m.parameters())
    assert frac < 0.10
    assert any("parameters trainable" in r.getMessage() and f"{100 * frac:.2f} %" in r.getMessage()
               for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        vlm(lm_dir, projector_hidden=1024)
    assert any(r.levelno == logging.WARNING and "frozen LM" in r.getMessage() for r in caplog.records)
    m(vlm_batch()[0])["loss"].backward()
    assert all(p.grad is None for n, p in m.named_parameters() if not n.startswith("projector."))
    # a batch without images still reaches the projection (DDP: no unused parameters)
    m.zero_grad()
    text_only = {"input_ids": torch.tensor([[BOT, 5, 6, EOT]]), "labels": torch.tensor([[-100, -100, 6, EOT]])}
    m(text_only)["loss"].backward()
    assert all(p.grad is not None for p in m.projector.parameters())


def test_optimizer_groups(lm_dir):
    m = vlm(lm_dir, lora=True, projection_lr=1e-2)
    groups = m.optimizer_groups(1e-3, 0.1)
    by = {g["name"]: g for g in groups}
    assert set(by) == {"projection", "projection_no_decay", "lm"}   # LoRA matrices only: no lm_no_decay
    assert by["projection"]["lr"] == by["projection_no_decay"]["lr"] == 1e-2 and by["lm"]["lr"] == 1e-3
    assert by["projection"]["weight_decay"] == 0.1 and by["projection_no_decay"]["weight_decay"] == 0.0
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in m.parameters() if p.requires_grad) and len(set(ids)) == len(ids)
    assert all(p.dim() < 2 for p in by["projection_no_decay"]["params"])
    assert vlm(lm_dir).optimizer_groups(1e-3, 0.0)[0]["lr"] == 1e-3          # default: the run's lr
    torch.optim.AdamW(groups, lr=1e-3)                                       # a valid AdamW spec
    t = tts(lm_dir, audio_lr=5e-3).optimizer_groups(1e-3, 0.1)
    assert {g["name"]: g["lr"] for g in t} == {"audio": 5e-3, "lm": 1e-3, "lm_no_decay": 1e-3}


# ---- registry, data spec, training -------------------------------------------------------------------

def test_build_model_reads_the_manifest(lm_dir, tmp_path):
    from test_train_support import cache_with_manifest
    from transformers import AutoTokenizer

    from shards.tokens import vocab_sha256
    man = {"n_codebooks": Q, "codebook_size": CB, "latent_channels": C_LAT, "text_vocab_size": 1,
           "encoders": {"text_tokenizer": {"name": "hf", "vocab_sha256": vocab_sha256(AutoTokenizer.from_pretrained(lm_dir))}},
           "text": {"vocab_size": VOCAB, "pad_id": PAD, "special_token_ids": {
               "<|AUDIO|>": A_IN, "<|AUDIO_OUT|>": A_OUT, "<|audio_out_bos|>": AO_BOS, "<|audio_eos|>": A_EOS,
               "<image>": IMG, "<|eot_id|>": EOT}}}
    spec = Cache.open(cache_with_manifest(tmp_path / "c", man, Q=Q, latents=True))
    assert (spec.codec.n_codebooks, spec.codec.codebook_size, spec.vocab_size, spec.latent_channels, spec.pad_id) == \
        (Q, CB, VOCAB, C_LAT, PAD)
    m = build_model("tts", {"lm": lm_dir}, spec)
    assert isinstance(m, TTSModel) and m.fields == ("input_ids", "labels", "codes", "audio_segments")
    assert (m.audio_out_token_id, m.audio_in_token_id, m.n_codebooks, m.stream_eos) == (A_OUT, A_IN, Q, CB + 1)
    assert m.lm.get_input_embeddings().weight.shape[0] == VOCAB            # resized from 264
    v = build_model("vlm", {"lm": lm_dir, "patch_size": 1, "projector": "linear"}, spec)
    assert v.fields == ("input_ids", "labels", "latents") and v.image_token_id == IMG
    assert v.projector[0].in_features == C_LAT
    no_ids = dict(man, text={"vocab_size": VOCAB, "pad_id": PAD})
    with pytest.raises(ContractMismatch, match="special_tokens.<|AUDIO_OUT|>"):
        build_model("tts", {"lm": lm_dir}, cache_with_manifest(tmp_path / "no-ids", no_ids, Q=Q))
    # a cache made with another image placeholder (Gemma 3's) names it in text.placeholders
    gemma = json.loads(json.dumps(man))
    gemma["text"]["special_token_ids"] = {"<start_of_image>": IMG + 1, "<image>": IMG}
    gemma["text"]["placeholders"] = {"image": "<start_of_image>"}
    g = build_model("vlm", {"lm": lm_dir, "patch_size": 1, "projector": "linear"},
                    cache_with_manifest(tmp_path / "gemma", gemma, Q=Q, latents=True))
    assert g.image_token_id == IMG + 1
    with pytest.raises(FileNotFoundError, match="tools.testing"):
        build_model("vlm", {"lm": str(tmp_path / "no" / "such-lm")}, spec)


@pytest.mark.parametrize("kind", ["tts", "vlm"])
def test_overfits_one_batch(lm_dir, kind):
    if kind == "tts":
        m = tts(lm_dir)
        batch = collate([render(TTS_SAMPLE, seed=7), render([("text", [BOT, 3], False), ("out", 5, True),
                                                               ("text", [EOT], True)], seed=8)])
        lr = 3e-3
    else:
        m = vlm(lm_dir)
        batch = vlm_batch(seed=9)[0]
        lr = 1e-2
    opt = torch.optim.AdamW(m.optimizer_groups(lr, 0.0))
    losses = []
    for _ in range(30):
        loss = m(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
