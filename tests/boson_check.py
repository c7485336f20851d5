"""Run inside the boson-multimodal venv (``make boson-venv``) by tests/test_higgs_boson.py:
``python tests/boson_check.py CACHE MANIFEST TOKENIZER_DIR AUDIO_TOKENIZER_DIR [TEXT_TOKENIZER_DIR]`` prints one
JSON line of findings (TOKENIZER_DIR: the model's checkpoint, whose contract the dataset checks; AUDIO_TOKENIZER_DIR:
the audio tokenizer the cache's codes come from; TEXT_TOKENIZER_DIR: its text tokenizer in a form transformers 4.46
loads, where the checkpoint's is not).

``loaders.higgs.HiggsChatMLDataset`` over CACHE (a voice-cloning cache of MANIFEST's records) against
Boson's own code, transformers 4.46:

* ``input_ids``/``label_ids`` of each sample == ``prepare_chatml_sample(record, tokenizer)`` (Boson's
  rule: the ``<|AUDIO_OUT|>`` of a trained turn labelled);
* ``HiggsAudioSampleCollator`` (delay pattern, 8 codebooks) over the samples: the columns of
  ``label_audio_ids`` with a label are reported with the columns each audio item occupies;
* ``HiggsAudioModel`` (tiny random config) runs forward on the collated batch.

``python tests/boson_check.py render RECORDS TOKENIZER_DIR``: ``prepare_chatml_sample(record, tokenizer)``
of each ChatML record of the JSON list RECORDS, one JSON line ``[[input_ids, label_ids] | null, ...]``
(null where Boson refuses the record: its function catches the error, then fails printing the sample).

``python tests/boson_check.py checkpoint OUT CONFIG_JSON``: a stand-in of Boson's released checkpoint
written by Boson's own code (tests/test_higgs_conversion.py): ``HiggsAudioModel(HiggsAudioConfig(**CONFIG
["config"]))`` with its partially frozen text embedding and text head switched on (``freeze_llm`` /
``freeze_text_head`` at ``CONFIG["freeze_until"]``) and its audio head wrapped in Boson's
``PartiallyFrozenLinear`` at ``CONFIG["freeze_audio_head_until"]`` (0.1.1 has no method that splits it; the
conversion script merges it when present), every weight random, saved with ``save_pretrained`` as
safetensors shards of ``CONFIG["max_shard_size"]``. Prints one JSON line: the state_dict's key names.
"""
from __future__ import annotations

import json
import sys

import torch


def main(cache: str, manifest: str, tokenizer_dir: str, audio_tokenizer: str, text_tokenizer: str | None = None) -> dict:
    from boson_multimodal.data_collator.higgs_audio_collator import HiggsAudioSampleCollator
    from boson_multimodal.dataset.chatml_dataset import ChatMLDatasetSample, prepare_chatml_sample
    from boson_multimodal.model.higgs_audio import HiggsAudioConfig, HiggsAudioModel
    from transformers import PreTrainedTokenizerFast

    from loaders.higgs import HiggsChatMLDataset
    from shards import read_manifest

    tok = PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_dir}/tokenizer.json")
    records = {r["misc"]["key"]: r for r in json.load(open(manifest))}
    ds = HiggsChatMLDataset(cache, tokenizer_dir, tokenizer=text_tokenizer, audio_tokenizer=audio_tokenizer)
    ids = read_manifest(cache)["text"]["special_token_ids"]
    out: dict = {"n": len(ds), "speakers": ds.speakers, "same_tokens": [], "same_labels": []}
    samples = []
    for i in range(len(ds)):
        s = ds[i]
        assert isinstance(s, ChatMLDatasetSample)
        key = ds.reader.keys[i]
        want_ids, want_labels, audio, _ = prepare_chatml_sample(dict(records[key]), tok)
        out["same_tokens"].append(s.input_ids.tolist() == want_ids)
        out["same_labels"].append(s.label_ids.tolist() == want_labels)
        samples.append(s)
    Q = 8
    collator = HiggsAudioSampleCollator(
        whisper_processor=None, encode_whisper_embed=False, audio_in_token_id=ids["<|AUDIO|>"],
        audio_out_token_id=ids["<|AUDIO_OUT|>"], pad_token_id=read_manifest(cache)["text"]["pad_id"],
        audio_stream_bos_id=1024, audio_stream_eos_id=1025, return_audio_in_tokens=False,
        use_delay_pattern=True, audio_num_codebooks=Q, round_to=8)
    batch = collator(samples[:4])
    lab = batch.label_audio_ids
    out["label_audio_ids_shape"] = list(lab.shape)
    out["trained_columns"] = (lab != -100).any(0).nonzero().flatten().tolist()
    out["audio_out_ids_start"] = batch.audio_out_ids_start.tolist()
    # where each item landed: its start column and width (frames + Q + 1), and whether Boson trains it
    out["items"] = []
    for b, s in enumerate(samples[:4]):
        rec = records[ds.reader.keys[b]]
        turns = [k for k, m in enumerate(rec["messages"]) if m["role"] == "assistant"
                 and (isinstance(m["content"], dict) and m["content"].get("type") == "audio")]
        for k, start in enumerate(s.audio_ids_start.tolist()):
            end = s.audio_ids_start[k + 1] if k + 1 < len(s.audio_ids_start) else s.audio_ids_concat.shape[1]
            out["items"].append({"frames": int(end - start), "target": turns[k] >= (rec.get("start_index") or 0)})
    torch.manual_seed(0)
    cfg = HiggsAudioConfig(
        text_config=dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        audio_adapter_type="dual_ffn_fast_forward", audio_dual_ffn_layers=[0, 1], audio_ffn_hidden_size=64,
        audio_ffn_intermediate_size=128, encode_whisper_embed=False, skip_audio_tower=True, use_delay_pattern=True,
        audio_num_codebooks=Q, audio_codebook_size=1024, audio_in_token_idx=ids["<|AUDIO|>"],
        audio_out_token_idx=ids["<|AUDIO_OUT|>"], audio_out_bos_token_id=ids["<|audio_out_bos|>"],
        audio_eos_token_id=ids["<|audio_eos|>"], pad_token_id=read_manifest(cache)["text"]["pad_id"])
    model = HiggsAudioModel(cfg).eval()
    with torch.no_grad():
        res = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    audio_out_ids=batch.audio_out_ids, audio_out_ids_start=batch.audio_out_ids_start,
                    audio_out_ids_start_group_loc=batch.audio_out_ids_start_group_loc,
                    label_ids=batch.label_ids, label_audio_ids=batch.label_audio_ids)
    logits = res.audio_logits            # (audio_out_total_length, Q, codebook_size + 2)
    out["audio_logits_shape"] = list(logits.shape)
    out["finite"] = bool(torch.isfinite(logits).all()) and bool(torch.isfinite(res.logits).all())
    keep = lab.T != -100                 # (columns, Q)
    ce = torch.nn.functional.cross_entropy(logits[keep], lab.T[keep])
    out["audio_ce"] = float(ce)
    return out


def render(records: str, tokenizer_dir: str) -> list:
    """Boson's ``prepare_chatml_sample`` of each record: ``[input_ids, label_ids]`` or None."""
    from boson_multimodal.dataset.chatml_dataset import prepare_chatml_sample
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=f"{tokenizer_dir}/tokenizer.json")
    out = []
    for rec in json.load(open(records)):
        try:
            ids, labels, _, _ = prepare_chatml_sample(dict(rec), tok)
        except TypeError:   # its except branch json.dumps() the ChatMLSample it could not render
            ids = labels = None
        out.append(None if ids is None else [ids, labels])
    return out


def checkpoint(out_dir: str, config_json: str) -> list:
    """Boson's ``HiggsAudioModel`` of the given config, its embedding/heads split as in training, saved."""
    from boson_multimodal.model.higgs_audio import HiggsAudioConfig, HiggsAudioModel
    from boson_multimodal.model.higgs_audio.custom_modules import PartiallyFrozenLinear

    spec = json.load(open(config_json))
    torch.manual_seed(spec.get("seed", 0))
    model = HiggsAudioModel(HiggsAudioConfig(**spec["config"]))
    model.freeze_llm(freeze_embed=True, freeze_embed_until_idx=spec["freeze_until"])
    model.freeze_text_head(freeze_text_head_until_idx=spec["freeze_until"])
    proj = model.audio_decoder_proj
    proj.audio_lm_head = PartiallyFrozenLinear(proj.audio_lm_head, freeze_until_idx=spec["freeze_audio_head_until"])
    with torch.no_grad():          # no weight keeps its initial value (norms start at 1, as a fresh model's)
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=spec["max_shard_size"])
    return sorted(model.state_dict())


if __name__ == "__main__":
    if sys.argv[1] == "checkpoint":
        print(json.dumps(checkpoint(*sys.argv[2:4])))
    elif sys.argv[1] == "render":
        print(json.dumps(render(*sys.argv[2:4])))
    else:
        print(json.dumps(main(*sys.argv[1:6])))
