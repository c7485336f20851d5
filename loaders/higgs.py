"""Higgs-Audio v2 batches from the cache: the model's own layouts, built from the cached tensors.

Two consumers, two layouts, nothing re-tokenized and no codec run (torch and numpy only; neither
``transformers`` nor ``boson_multimodal`` is imported with this module: the contract below reads a
checkpoint's files with ``transformers`` when asked, ``boson_multimodal`` builds the samples):

* :class:`HiggsBatch` (``transformers``' ``HiggsAudioV2ForConditionalGeneration``): a loader
  ``transform`` turning a collated batch (``input_ids``, ``labels``, ``codes``, ``audio_segments``)
  into the batch ``HiggsAudioV2Processor(..., output_labels=True)`` builds on the fly. The
  ``--model.name higgs`` recipe hands it to the loader as its ``batch_transform``.
* :class:`HiggsChatMLDataset` (``boson_multimodal``'s trainer): a map-style dataset of
  ``ChatMLDatasetSample`` for ``HiggsAudioSampleCollator``, in place of a dataset that tokenizes
  and runs the audio tokenizer per step.

The cache renders conversations in Higgs-Audio's own layout (``precompute.chat``, ``chat_template:
llama3``: Boson's ``prepare_chatml_sample``): one ``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``
per assistant audio item, ``<|audio_bos|><|AUDIO|><|audio_eos|>`` per user/system audio item, item k's
codes at ``codes[:, s:s + n]`` with ``[s, n]`` = columns 3, 4 of row k of ``audio_segments``.

What the ``transformers`` processor does (``processing_higgs_audio_v2.py``, 5.x), and so
:class:`HiggsBatch`:

1. each ``<|AUDIO_OUT|>`` becomes ``n + 2`` audio tokens then ``Q - 1`` delay tokens
   (``<|reserved_special_token_6|>``), one per column of the item's delayed codes;
2. an item's codes ``(Q, n)`` get a stream-BOS column (1024) in front and a stream-EOS column
   (1025) behind, then the MusicGen delay pattern: codebook q is shifted right by q, BOS fills the
   start and EOS the end, ``(Q, n + 2) -> (Q, n + Q + 1)``; ``audio_input_ids (B, T, Q)`` holds a
   sample's items one after another, right-padded with stream EOS, ``audio_input_ids_mask (B, T)``
   True on real columns;
3. text is **left**-padded with the tokenizer's pad (``padding_side="left"``), ``attention_mask``
   int64;
4. ``labels`` = ``input_ids`` with ``<|AUDIO_OUT|>``, pad and ``<|audio_out_bos|>`` set to -100:
   every other token trains, system and user text and the delay tokens included;
   ``audio_labels`` = ``audio_input_ids`` with stream BOS and EOS set to -100: **every** audio item
   trains (the reference clip of a voice-cloning sample too), the stream EOS never.

``labels="targets"`` (opt-in) keeps the model input identical and trains what a Higgs-Audio ChatML
sample with ``start_index`` trains (Boson's ``prepare_chatml_sample`` + ``HiggsAudioSampleCollator``):
text labels are the cached ones (assistant turns at or after ``start_index``; -100 on the expanded
audio tokens), audio labels only for the items of those turns, and as in Boson's collator their
stream EOS is trained (``[-100, codes, EOS]`` delayed, -100 fill).

Audio in a user or system turn (``<|AUDIO|>``, the audio-understanding manifests): Higgs-Audio v2's
chat template renders only the text items of such turns (it drops the audio) and the processor
expands only ``<|AUDIO_OUT|>``; given such a conversation with its audio, ``apply_chat_template``
fails (more audios than audio tokens). The generation model has no audio encoder (Boson's
Whisper tower is not part of the ``transformers`` port). So by default (``input_audio="drop"``)
the ``<|audio_bos|><|AUDIO|><|audio_eos|>`` of such an item is removed and its codes are not used:
the text the template renders. ``input_audio="codes"`` feeds them to the model as codes instead,
written as the template writes audio of the ``scene`` turn (``<|audio_out_bos|><|AUDIO_OUT|>
<|audio_eos|>`` in place of the three tokens), never trained with ``labels="targets"``.

The delay pattern itself (:func:`build_delay_pattern`, :func:`delay_segments`, used by the ``tts``
recipe too) lives here.

Other differences between the cached (Boson) layout and the template, handled or documented: the
template ends every turn with ``<|eot_id|>`` (Boson ends an assistant turn followed by another with
``<|eom_id|>``: replaced by ``<|eot_id|>`` here); it trims each text item (the cache does not: equal
for text without leading/trailing whitespace); it refuses assistant text (the cache renders it as
Boson does; the processor itself takes any text).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from shards.kinds import WAVEFORM
from shards.schema import SEGMENT_COLUMNS
from shards.tokens import AUDIO_IN, AUDIO_OUT as AUDIO_OUT_ID, AUDIO_OUT_BOS as AUDIO_OUT_BOS_ID, IGNORE_INDEX

log = logging.getLogger("loaders")

#: ``audio_segments`` columns
_DIR, _START, _FRAMES, _SPEAKER = (SEGMENT_COLUMNS.index(c) for c in ("direction", "code_start", "code_frames",
                                                                       "speaker"))
LABELS = ("processor", "targets")
INPUT_AUDIO = ("drop", "codes")


def delay_segments(codes: torch.Tensor, seg_batch: torch.Tensor, start: torch.Tensor, frames: torch.Tensor,
                   bos: int, eos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delayed input ids and labels of N audio items at once.

    codes (B, Q, F) int64; item i = ``codes[seg_batch[i], :, start[i]:start[i] + frames[i]]``.
    Returns ids (N, Q, M) int64, labels (N, Q, M) int64, lengths (N,) = frames + Q + 1, with
    M = max(lengths) (1 when N = 0). Column j, codebook q reads stream column c = j - q of
    ``[BOS, codes, EOS]``: ids are BOS for c <= 0, the code for 1 <= c <= n, EOS after; labels are the
    code, EOS at c = n + 1, -100 elsewhere (also past ``lengths``). Raises ``ValueError`` when an
    item reads padded (negative) codes or codes >= ``bos``.
    """
    B, Q, Fr = codes.shape
    N = seg_batch.numel()
    lengths = frames + Q + 1
    M = int(lengths.max()) if N else 1
    dev = codes.device
    j = torch.arange(M, device=dev)
    q = torch.arange(Q, device=dev)
    c = (j[None, None, :] - q[None, :, None]).expand(N, Q, M)          # stream column
    n = frames[:, None, None]
    in_codes = (c >= 1) & (c <= n)
    idx = (start[:, None, None] + c - 1).clamp(0, max(Fr - 1, 0))
    if Fr:
        got = codes[seg_batch[:, None, None], q[None, :, None], idx]
    else:
        got = torch.zeros((N, Q, M), dtype=torch.long, device=dev)
    bad = in_codes & ((got < 0) | (got >= bos))
    if N and bool(bad.any()):
        i = int(bad.flatten(1).any(1).nonzero()[0])
        raise ValueError(f"audio item {i} (sample {int(seg_batch[i])}, code_start {int(start[i])}, "
                         f"code_frames {int(frames[i])}) reads codes outside [0, {bos}): padded frames "
                         f"(codes has {Fr}) or a codebook_size smaller than the cache's")
    ids = torch.where(c <= 0, torch.full_like(got, bos), torch.where(in_codes, got, torch.full_like(got, eos)))
    labels = torch.where(in_codes, got, torch.where(c == n + 1, torch.full_like(got, eos),
                                                    torch.full_like(got, IGNORE_INDEX)))
    labels = labels.masked_fill(~(j[None, :] < lengths[:, None])[:, None, :], IGNORE_INDEX)
    return ids, labels, lengths


def build_delay_pattern(codes: torch.Tensor, bos: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels), both (Q, n + Q + 1) int64, of one item's codes (Q, n) (see :func:`delay_segments`).

    Q = 3, n = 2, codes [[a, b], [c, d], [e, f]] (B = bos, E = eos, _ = -100)::

        ids    [[B, a, b, E, E, E],     labels [[_, a, b, E, _, _],
                [B, B, c, d, E, E],             [_, _, c, d, E, _],
                [B, B, B, e, f, E]]             [_, _, _, e, f, E]]
    """
    Q, n = codes.shape
    z = torch.zeros(1, dtype=torch.long, device=codes.device)
    ids, labels, _ = delay_segments(codes[None].long(), z, z, z + n, bos, eos)
    return ids[0], labels[0]


def revert_delay_pattern(delayed: torch.Tensor) -> torch.Tensor:
    """(Q, M) delayed -> (Q, M - Q + 1) undelayed (Higgs ``revert_delay_pattern``); for ids from
    :func:`build_delay_pattern` this is ``[BOS, codes, EOS]``."""
    Q, M = delayed.shape
    return torch.stack([delayed[q, q:M - Q + 1 + q] for q in range(Q)])


@dataclass
class _Item:
    codes: torch.Tensor    # (Q, n)
    trained: bool          # targets: this item's frames (and stream EOS) are labels


class HiggsBatch:
    """Loader transform: a collated cache batch -> ``HiggsAudioV2ForConditionalGeneration`` inputs
    exactly as ``HiggsAudioV2Processor(text, audio, output_labels=True)`` returns them (see the
    module docstring for the layout and the two label modes).

    Args (token ids: the model's config and the cache's ``manifest.json``; the recipe fills them):
        audio_token_id: ``<|AUDIO_OUT|>`` (config ``audio_token_id``).
        audio_bos_token_id: ``<|audio_out_bos|>`` (config ``audio_bos_token_id``).
        audio_delay_token_id: the delay token (config ``audio_delay_token_id``).
        pad_token_id: the text pad (the tokenizer's, = the cache's ``text.pad_id``).
        audio_stream_bos_id, audio_stream_eos_id: stream BOS/EOS codes (1024, 1025 for Higgs v2).
        num_codebooks: Q (the cache's ``n_codebooks`` must equal it).
        audio_in_token_id, audio_in_bos_token_id, audio_eos_token_id: ``<|AUDIO|>``, ``<|audio_bos|>``,
            ``<|audio_eos|>`` (input audio items; optional when the cache has none).
        eot_token_id, eom_token_id: ``<|eot_id|>``/``<|eom_id|>`` (``<|eom_id|>`` -> ``<|eot_id|>``).
        labels: ``processor`` (default) | ``targets``.
        input_audio: ``drop`` (default) | ``codes``.

    Input batch (``loaders.collate``): ``input_ids``/``labels`` int64 (B, L) right-padded,
    ``input_lengths`` (B,), ``codes`` int64 (B, Q, F) padded -100, ``audio_segments`` int64 (B, S, 6),
    ``audio_segments_count`` (B,), ``keys``. Output: ``input_ids`` int64 (B, L'), ``attention_mask``
    int64 (B, L'), ``labels`` int64 (B, L'), and when any sample has a kept audio item
    ``audio_input_ids`` int64 (B, T, Q), ``audio_input_ids_mask`` bool (B, T), ``audio_labels``
    int64 (B, T, Q) (the processor leaves them out for text only); ``keys`` (and ``source``) as given.

    Raises ``ValueError`` naming the sample's key when its placeholders and ``audio_segments``
    disagree (count or direction), an item reads codes outside ``[0, audio_stream_bos_id)``, or the
    codes have another number of codebooks.
    """

    fields = ("input_ids", "labels", "codes", "audio_segments")

    @staticmethod
    def fields_read(labels: str = "processor") -> tuple[str, ...]:
        """The cached fields a batch of this ``labels`` mode is built from: ``processor`` labels come from the
        ids (the cached ``labels`` are not read), ``targets`` from the cached ``labels``."""
        if labels not in LABELS:
            raise ValueError(f"labels: expected one of {LABELS}, got {labels!r}")
        return HiggsBatch.fields if labels == "targets" else tuple(f for f in HiggsBatch.fields if f != "labels")

    def __init__(self, *, audio_token_id: int, audio_bos_token_id: int, audio_delay_token_id: int,
                 pad_token_id: int, audio_stream_bos_id: int, audio_stream_eos_id: int, num_codebooks: int,
                 audio_in_token_id: int | None = None, audio_in_bos_token_id: int | None = None,
                 audio_eos_token_id: int | None = None, eot_token_id: int | None = None,
                 eom_token_id: int | None = None, labels: str = "processor", input_audio: str = "drop"):
        if labels not in LABELS:
            raise ValueError(f"labels: expected one of {LABELS}, got {labels!r}")
        if input_audio not in INPUT_AUDIO:
            raise ValueError(f"input_audio: expected one of {INPUT_AUDIO}, got {input_audio!r}")
        self.audio_token_id, self.audio_bos_token_id = int(audio_token_id), int(audio_bos_token_id)
        self.delay_id, self.pad_id = int(audio_delay_token_id), int(pad_token_id)
        self.stream_bos, self.stream_eos = int(audio_stream_bos_id), int(audio_stream_eos_id)
        self.Q = int(num_codebooks)
        self.audio_in_token_id, self.audio_in_bos_token_id = audio_in_token_id, audio_in_bos_token_id
        self.audio_eos_token_id = audio_eos_token_id
        self.eot_token_id, self.eom_token_id = eot_token_id, eom_token_id
        self.labels, self.input_audio = labels, input_audio
        self._warned = False

    def __repr__(self) -> str:
        return f"HiggsBatch(labels={self.labels!r}, input_audio={self.input_audio!r}, num_codebooks={self.Q})"

    # -- one sample -------------------------------------------------------------------------------
    def _sample(self, key: str, ids: torch.Tensor, lab: torch.Tensor, codes: torch.Tensor,
                segs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[_Item]]:
        """(input_ids (L',), labels (L',) before the processor's rule, items in order) of one sample."""
        out_ph = ids == self.audio_token_id
        in_ph = ids == self.audio_in_token_id if self.audio_in_token_id is not None else torch.zeros_like(out_ph)
        pos = (out_ph | in_ph).nonzero().flatten().tolist()
        if len(pos) != len(segs):
            raise ValueError(f"sample {key!r}: {len(pos)} audio placeholder tokens but {len(segs)} audio_segments "
                             "rows (are the token ids those of the cache's tokenizer?)")
        pieces_ids: list[torch.Tensor] = []
        pieces_lab: list[torch.Tensor] = []
        items: list[_Item] = []
        at = 0
        for p, seg in zip(pos, segs.tolist()):
            is_out = bool(out_ph[p])
            if is_out != (seg[_DIR] == 1):
                raise ValueError(f"sample {key!r}: audio_segments direction {seg[_DIR]} disagrees with the "
                                 f"placeholder token at {p} ({AUDIO_OUT_ID} is an output item, {AUDIO_IN} an input item)")
            s, n = seg[_START], seg[_FRAMES]
            item = codes[:, s:s + n]
            if item.shape[1] != n or (n and (int(item.min()) < 0 or int(item.max()) >= self.stream_bos)):
                raise ValueError(f"sample {key!r}: audio item at code_start {s}, {n} frames reads codes outside "
                                 f"[0, {self.stream_bos}) (padding, or a codec larger than the model's codebooks)")
            if not is_out and self.input_audio == "drop":
                a, b = p, p + 1                                   # drop <|audio_bos|><|AUDIO|><|audio_eos|>
                if p > 0 and int(ids[p - 1]) == self.audio_in_bos_token_id:
                    a = p - 1
                if p + 1 < len(ids) and int(ids[p + 1]) == self.audio_eos_token_id:
                    b = p + 2
                pieces_ids.append(ids[at:a])
                pieces_lab.append(lab[at:a])
                at = b
                continue
            trained = is_out and int(lab[p]) != IGNORE_INDEX   # Boson's rule: the placeholder's label
            head_ids, head_lab = ids[at:p], lab[at:p]
            if not is_out:                                        # input item as codes: scene-style tokens
                head_ids = head_ids.clone()
                head_lab = head_lab.clone()
                if len(head_ids) and int(head_ids[-1]) == self.audio_in_bos_token_id:
                    head_ids[-1] = self.audio_bos_token_id
                    head_lab[-1] = IGNORE_INDEX
            pieces_ids.append(head_ids)
            pieces_lab.append(head_lab)
            width = n + self.Q + 1
            pieces_ids.append(torch.cat([torch.full((n + 2,), self.audio_token_id, dtype=torch.long),
                                         torch.full((self.Q - 1,), self.delay_id, dtype=torch.long)]))
            pieces_lab.append(torch.full((width,), IGNORE_INDEX, dtype=torch.long))
            items.append(_Item(item, trained))
            at = p + 1
            if not is_out and at < len(ids) and int(ids[at]) == self.audio_eos_token_id:
                pieces_ids.append(ids[at:at + 1])
                pieces_lab.append(torch.full((1,), IGNORE_INDEX, dtype=torch.long))
                at += 1
        pieces_ids.append(ids[at:])
        pieces_lab.append(lab[at:])
        new_ids = torch.cat(pieces_ids)
        new_lab = torch.cat(pieces_lab)
        if self.eom_token_id is not None and self.eot_token_id is not None:
            eom = new_ids == self.eom_token_id
            new_ids = new_ids.masked_fill(eom, self.eot_token_id)
            new_lab = torch.where(eom & (new_lab != IGNORE_INDEX), torch.full_like(new_lab, self.eot_token_id), new_lab)
        return new_ids, new_lab, items

    # -- the batch --------------------------------------------------------------------------------
    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        ids_b = batch["input_ids"].long()
        # processor labels are made from the ids below: the cached labels are not read (fields_read)
        lab_b = batch["labels"].long() if self.labels == "targets" else torch.full_like(ids_b, IGNORE_INDEX)
        B = ids_b.shape[0]
        keys = batch.get("keys") or [str(i) for i in range(B)]
        lengths = batch.get("input_lengths")
        if lengths is None:
            lengths = torch.full((B,), ids_b.shape[1], dtype=torch.long)
        codes = batch.get("codes")
        if codes is not None and codes.shape[1] != self.Q and codes.numel():
            raise ValueError(f"the cache's codes have {codes.shape[1]} codebooks, the model {self.Q}")
        seg = batch.get("audio_segments")
        count = batch.get("audio_segments_count")
        texts, labs, audio = [], [], []
        for b in range(B):
            n = int(lengths[b])
            k = int(count[b]) if count is not None else (int((seg[b, :, 0] >= 0).sum()) if seg is not None else 0)
            segs = seg[b, :k].long() if seg is not None else torch.zeros((0, 6), dtype=torch.long)
            c = codes[b].long() if codes is not None else torch.zeros((self.Q, 0), dtype=torch.long)
            t, lb, items = self._sample(keys[b], ids_b[b, :n], lab_b[b, :n], c, segs)
            if self.input_audio == "drop" and len(items) < len(segs) and not self._warned:
                self._warned = True
                log.warning("sample %r has audio in a user/system turn (%s): Higgs-Audio v2's chat template "
                            "drops it and the model has no audio encoder; dropped (input_audio=codes feeds its "
                            "codes instead)", keys[b], AUDIO_IN)
            texts.append(t)
            labs.append(lb)
            audio.append(items)
        L = max((len(t) for t in texts), default=0)
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
        for b, (t, lb) in enumerate(zip(texts, labs)):          # left padding, as the processor
            if len(t):
                input_ids[b, L - len(t):] = t
                attention_mask[b, L - len(t):] = 1
                labels[b, L - len(t):] = lb
        if self.labels == "processor":
            labels = input_ids.masked_fill((input_ids == self.audio_token_id) | (input_ids == self.pad_id)
                                           | (input_ids == self.audio_bos_token_id), IGNORE_INDEX)
        out: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if any(audio):
            out.update(self._audio(audio))
        for k in ("keys", "source"):
            if k in batch:
                out[k] = batch[k]
        return out

    def _audio(self, audio: list[list[_Item]]) -> dict[str, torch.Tensor]:
        cols, labels = [], []
        for items in audio:
            per_ids, per_lab = [], []
            for it in items:
                # (Q, n + Q + 1) each; Boson's labels: [-100, codes, EOS] delayed, -100 fill (the stream EOS trains)
                d, boson = build_delay_pattern(it.codes, self.stream_bos, self.stream_eos)
                if self.labels == "targets":
                    lab = boson if it.trained else torch.full_like(boson, IGNORE_INDEX)
                else:     # the processor's: the ids with stream BOS/EOS -100
                    lab = d.masked_fill((d == self.stream_bos) | (d == self.stream_eos), IGNORE_INDEX)
                per_ids.append(d.T)
                per_lab.append(lab.T)
            cols.append(torch.cat(per_ids) if per_ids else torch.zeros((0, self.Q), dtype=torch.long))
            labels.append(torch.cat(per_lab) if per_lab else torch.zeros((0, self.Q), dtype=torch.long))
        B, T = len(cols), max(len(c) for c in cols)
        ids = torch.full((B, T, self.Q), self.stream_eos, dtype=torch.long)
        lab = torch.full((B, T, self.Q), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.bool)
        for b, (c, lb) in enumerate(zip(cols, labels)):
            ids[b, :len(c)] = c
            lab[b, :len(c)] = lb
            mask[b, :len(c)] = True
        if self.labels == "processor":   # the processor's rule over the padded tensor (padding is EOS: -100)
            lab = ids.masked_fill((ids == self.stream_bos) | (ids == self.stream_eos), IGNORE_INDEX)
        return {"audio_input_ids": ids, "audio_input_ids_mask": mask, "audio_labels": lab}


# -- what a Higgs-Audio v2 checkpoint needs from a cache (its contract) ----------------------------------

#: Higgs-Audio v2's audio tokenizer (``HiggsAudioV2TokenizerModel``): 24 kHz audio, 960 samples a frame
CODEC_NAME, CODEC_SAMPLE_RATE, CODEC_FRAME_RATE = "higgs", 24000, 25.0
#: the files of a checkpoint that name its paired audio tokenizer (``transformers``' processor: the
#: ``audio_tokenizer`` entry of ``processor_config.json``, or ``audio_tokenizer_config.json``)
PROCESSOR_FILES = ("audio_tokenizer_config.json", "processor_config.json")
#: a checkpoint's ``config.json`` keys -> what they are, by ``model_type``: ``transformers``' form
#: (``HiggsAudioV2Config``) and Boson's own (``boson_multimodal`` ``HiggsAudioConfig``, what its trainer trains)
CONFIG_KEYS = {"higgs_audio_v2": {"n_codebooks": "num_codebooks", "codebook_size": "audio_stream_bos_id",
                                  AUDIO_OUT_ID: "audio_token_id", AUDIO_OUT_BOS_ID: "audio_bos_token_id"},
               "higgs_audio": {"n_codebooks": "audio_num_codebooks", "codebook_size": "audio_codebook_size",
                               AUDIO_OUT_ID: "audio_out_token_idx", AUDIO_OUT_BOS_ID: "audio_out_bos_token_id"}}


def checkpoint_config(lm: Any, revision: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(model_type, config.json)`` of Higgs-Audio checkpoint ``lm`` (a directory or hub id), read as the file
    holds it (no ``transformers`` class needed: Boson's trainer runs ``transformers`` 4.46). Raises ``ValueError``
    for a checkpoint of another ``model_type`` (:data:`CONFIG_KEYS`),
    :class:`shardcache.weights.CheckpointUnreadable` for one without a readable ``config.json``."""
    from shardcache.pretrained import resolve_pretrained
    from shardcache.weights import CheckpointUnreadable, checkpoint
    ckpt = checkpoint(resolve_pretrained(lm, what="model.kwargs.lm"), revision=revision, what="model.kwargs.revision")
    p = ckpt.fetch("config.json")
    if p is None:
        raise CheckpointUnreadable(f"{ckpt} has no config.json: not a Higgs-Audio checkpoint")
    try:
        raw = json.loads(p.read_text())
        model_type = raw["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointUnreadable(f"{p}: not a model config ({type(e).__name__}: {e})") from e
    if model_type not in CONFIG_KEYS:
        raise ValueError(f"{ckpt} is {model_type!r}, not a Higgs-Audio checkpoint ({' or '.join(CONFIG_KEYS)})")
    return model_type, raw


def paired_audio_tokenizer(lm: Any, revision: str | None = None) -> str | None:
    """The audio tokenizer checkpoint ``lm``'s processor (at ``revision``) names (``audio_tokenizer_name_or_path``,
    what ``HiggsAudioV2Processor.from_pretrained`` loads: at its ``main``, whatever the processor's revision),
    None when it names none (no processor files)."""
    from shardcache.pretrained import resolve_pretrained
    from shardcache.weights import checkpoint
    ckpt = checkpoint(resolve_pretrained(lm, what="model.kwargs.lm"), revision=revision, what="model.kwargs.revision")
    for f in PROCESSOR_FILES:
        path = ckpt.fetch(f)
        d = json.loads(path.read_text()) if path else {}
        d = d.get("audio_tokenizer", d) if f == "processor_config.json" else d
        if isinstance(d, dict) and d.get("audio_tokenizer_name_or_path"):
            return str(d["audio_tokenizer_name_or_path"])
    return None


def codec_weights(lm: Any, audio_tokenizer: Any = None, *, revision: str | None = None,
                  audio_tokenizer_revision: str | None = None) -> Any:
    """The weights (:func:`shardcache.weights.weights_of`) of the audio tokenizer the model's codes come from:
    ``audio_tokenizer`` (``--model.audio_tokenizer``) when given, else the one checkpoint ``lm``'s processor
    config names; :class:`shards.cache.Unknown` (met by no cache, saying what to give) when neither names one
    or the paired one is not here. ``audio_tokenizer_revision``: the hub revision of ``audio_tokenizer``
    (``--model.audio_tokenizer_revision``); the paired one is read at its ``main``, as ``HiggsAudioV2Processor``
    loads it (``revision``: of ``lm``, whose processor config names it). Raises
    :class:`shardcache.weights.CheckpointUnreadable` for weights that are there and cannot be read."""
    from shardcache.pretrained import resolve_pretrained
    from shardcache.weights import CheckpointMissing, weights_of
    from shards.cache import Unknown
    if audio_tokenizer:
        return weights_of(resolve_pretrained(audio_tokenizer, what="--model.audio_tokenizer"),
                          revision=audio_tokenizer_revision, what="--model.audio_tokenizer_revision")
    if audio_tokenizer_revision:
        raise ValueError(f"--model.audio_tokenizer_revision {audio_tokenizer_revision!r} without "
                         "--model.audio_tokenizer: name the audio tokenizer (a hub id) whose revision it is")
    tok = paired_audio_tokenizer(lm, revision)
    if not tok:
        return Unknown(f"{lm} names no audio tokenizer (no processor_config.json): name the one its codes come "
                       "from with --model.audio_tokenizer (--audio_tokenizer_path)")
    try:
        return weights_of(resolve_pretrained(tok, what="the paired audio tokenizer"))
    except (CheckpointMissing, FileNotFoundError) as e:
        return Unknown(f"the paired audio tokenizer {tok} is not here ({e}): name a local copy with "
                       "--model.audio_tokenizer")


def contract_values(lm: Any, tokenizer: Any = None, audio_tokenizer: Any = None, *, revision: str | None = None,
                    tokenizer_revision: str | None = None,
                    audio_tokenizer_revision: str | None = None) -> dict[str, Any]:
    """The contract items (``{item: value}``, named as :meth:`shards.cache.Contract.items` names them) of
    Higgs-Audio checkpoint ``lm`` (its ``config.json``, tokenizer and processor files; the audio tokenizer's
    tensors, never the model's): codes of Higgs-Audio's own tokenizer (name, 24 kHz, 25 frames/s, the model's
    codebooks of ``codebook_size`` codes, hence its bandwidth in kbps: codebooks x log2(size) bits x 25 /
    1000; the weights of ``audio_tokenizer`` or the paired one: :func:`codec_weights`, computed in float32),
    rendered with Higgs-Audio's layout (``llama3``) and labelled on the answers, by its tokenizer (``tokenizer``
    when given, else the checkpoint's: fingerprint, every special id the batch reads, the pad id). What
    ``--model.name higgs`` and :class:`HiggsChatMLDataset` compare, alike. ``revision``, ``tokenizer_revision``,
    ``audio_tokenizer_revision``: the hub revisions of ``lm``, ``tokenizer`` and ``audio_tokenizer`` (default
    ``main``)."""
    import math

    from shardcache.pretrained import token_ids, tokenizer_identity, tokenizer_pad_id
    from shards.cache import Unknown
    from shards.tokens import AUDIO_BOS, AUDIO_EOS, EOM, EOT

    if lm is None and not (tokenizer and audio_tokenizer):
        raise ValueError("name the model's checkpoint (a directory or hub id), or its text tokenizer and its audio "
                         "tokenizer: what its contract compares with the cache")
    ids: dict[str, Any] = {}
    sizes: dict[str, Any] = {}
    if lm is not None:   # the model's codebooks and placeholder ids (else any: the tokenizer's ids still count)
        model_type, raw = checkpoint_config(lm, revision)
        keys = CONFIG_KEYS[model_type]
        size, n = int(raw[keys["codebook_size"]]), int(raw[keys["n_codebooks"]])
        sizes = {"codec.n_codebooks": n, "codec.codebook_size": size,
                 "codec.bandwidth": n * math.log2(size) * CODEC_FRAME_RATE / 1000}
        ids = {AUDIO_OUT_ID: int(raw[keys[AUDIO_OUT_ID]]), AUDIO_OUT_BOS_ID: int(raw[keys[AUDIO_OUT_BOS_ID]])}
    tok, fingerprint, _ = tokenizer_identity(lm, tokenizer, revision=revision, named_revision=tokenizer_revision)
    if tok is not None:
        names = (AUDIO_IN, AUDIO_BOS, AUDIO_EOS, EOT, EOM) + ((AUDIO_OUT_ID, AUDIO_OUT_BOS_ID) if lm is None else ())
        ids |= {t: i for t, i in token_ids(tok, names).items()
                if not isinstance(i, Unknown)}       # a token its tokenizer lacks is not read
    return {f"special_tokens.{t}": i for t, i in ids.items()} | sizes | {
        "pad_id": tokenizer_pad_id(tok) if tok is not None else None,
        "codec.name": CODEC_NAME, "codec.sample_rate": CODEC_SAMPLE_RATE, "codec.frame_rate": CODEC_FRAME_RATE,
        "codec.weights": codec_weights(lm, audio_tokenizer, revision=revision,
                                       audio_tokenizer_revision=audio_tokenizer_revision), "codec.dtype": "float32",
        "text_tokenizer": fingerprint, "chat_template": "llama3", "label_policy": "answers"}


def checkpoint_contract(lm: Any, *, tokenizer: Any = None, audio_tokenizer: Any = None, labels: str = "targets",
                        model: str = "loaders.higgs.HiggsChatMLDataset", **revisions: str | None):
    """The :class:`shards.cache.Contract` of :func:`contract_values`, reading the fields a batch of ``labels``
    is built from (:meth:`HiggsBatch.fields_read`: Boson's collator reads the cached labels, as ``targets``);
    ``revisions``: :func:`contract_values`' ``revision``, ``tokenizer_revision``, ``audio_tokenizer_revision``."""
    from shards.cache import Contract
    return Contract.from_items(model, contract_values(lm, tokenizer, audio_tokenizer, **revisions),
                               fields=HiggsBatch.fields,
                               reads=HiggsBatch.fields_read(labels))


# -- boson_multimodal's trainer -------------------------------------------------------------------

class HiggsChatMLDataset(torch.utils.data.Dataset):
    """Map-style dataset of ``boson_multimodal``'s ``ChatMLDatasetSample`` read from a cache: the
    drop-in for a ``HiggsAudioDataset`` that tokenizes and runs the audio tokenizer on every step.
    Use it with ``boson_multimodal.data_collator.higgs_audio_collator.HiggsAudioSampleCollator`` as
    before (``audio_in_token_id``/``audio_out_token_id``: the cache's ``<|AUDIO|>``/``<|AUDIO_OUT|>``
    ids, ``manifest.json`` ``text.special_token_ids``; ``use_delay_pattern``, ``audio_num_codebooks``,
    stream BOS/EOS as the model's config says).

    Per sample (``boson_multimodal/dataset/chatml_dataset.py``): ``input_ids`` / ``label_ids`` int64
    (L,) as ``prepare_chatml_sample`` renders them (the cache's ``input_ids``; labels in its
    convention: the ``<|AUDIO_OUT|>`` of a trained turn carries its own id, which is how the
    collator tells target items from context); ``audio_ids_concat`` int64
    (Q, F) every audio item's codes (input and output items, in order) and ``audio_ids_start`` int64
    (n_items,); ``audio_waveforms_concat`` float32 (T,) the waveforms of the **input** items (the
    collator reads them for its Whisper features, indexed among the input items), in [-1, 1], from
    the cache's ``waveforms`` field (default ``audio_16k`` when the cache has it, the Whisper rate:
    nothing to resample; else ``audio``), ``audio_waveforms_start`` int64 and ``audio_sample_rate``
    float32 (n_in,); ``audio_speaker_indices`` int64 (n_items,): each item's speaker in ONE map for
    the whole cache (:attr:`speakers`; -1 unknown), not a per-sample index.

    The model's contract is checked first, as ``shardcache train --model.name higgs`` checks it, before a
    sample is read (:func:`checkpoint_contract`; Boson's collator reads the cached labels, so their label
    policy is compared, as with ``labels: targets``): codes of the model's audio tokenizer (its weights,
    codebooks, rate), the model's text tokenizer and its special ids, Higgs-Audio's layout and labels.

    Args:
        cache: cache directory.
        checkpoint: the model's checkpoint (a directory or hub id): Boson's own (``model_type:
            higgs_audio``) or its ``transformers`` form (``higgs_audio_v2``); its config, tokenizer and
            processor files are read, never its weights. Without it, ``tokenizer`` and ``audio_tokenizer``
            are both needed (and the codebooks and placeholder ids are those of the tokenizer).
        tokenizer: the text tokenizer the model was trained with, for a checkpoint that ships none.
        audio_tokenizer: the audio tokenizer (``transformers`` format, the one stage one ran) the model's
            codes come from; needed where the checkpoint's processor names none (Boson's checkpoints).
        revision, tokenizer_revision, audio_tokenizer_revision: the hub revisions (branch, tag or commit;
            default ``main``) of ``checkpoint``, ``tokenizer`` and ``audio_tokenizer``, as ``shardcache train``'s
            ``model.kwargs.revision``, ``model.kwargs.tokenizer_revision`` and ``--model.audio_tokenizer_revision``.
        speakers: the speaker names in id order; default: the sorted distinct ``speaker`` values of
            the cache's index (the sample speakers). An item whose speaker is not in it gets -1.
        waveforms: ``auto`` | a waveform field of the cache (``audio``, ``audio_16k``...).
        sample_class: the class to build samples with (default: ``ChatMLDatasetSample``, imported
            from ``boson_multimodal`` on first use, so this module imports without it).

    Raises :class:`shards.ContractMismatch` (one line naming every item, the cache's value and the
    model's, as the trainer's), :class:`shardcache.weights.CheckpointUnreadable` for a checkpoint file that
    cannot be read, ``FileNotFoundError``/``ShardCorrupt`` from the reader for a missing or damaged cache,
    ``KeyError`` for a ``waveforms`` field the cache lacks, ``ImportError`` (with what to install)
    when ``boson_multimodal`` is missing and no ``sample_class`` is given.
    """

    def __init__(self, cache: str | Path, checkpoint: Any = None, *, tokenizer: Any = None, audio_tokenizer: Any = None,
                 speakers: Sequence[str] | None = None, waveforms: str = "auto", sample_class: Any = None,
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 audio_tokenizer_revision: str | None = None):
        from shards import ShardReader, read_manifest
        from shards.cache import Cache
        from shards.tokens import AUDIO_OUT, AUDIO_OUT_BOS

        from .dataset import cache_fields

        #: the contract checked against the cache (:func:`checkpoint_contract`)
        self.contract = checkpoint_contract(checkpoint, tokenizer=tokenizer, audio_tokenizer=audio_tokenizer,
                                            revision=revision, tokenizer_revision=tokenizer_revision,
                                            audio_tokenizer_revision=audio_tokenizer_revision)
        Cache.open(cache).require(self.contract)
        self.cache = Path(cache)
        self.reader = ShardReader(self.cache)
        manifest = read_manifest(self.cache)
        self.n_codebooks = int(manifest.get("n_codebooks") or 8)
        ids = ((manifest.get("text") or {}).get("special_token_ids") or {})
        self.audio_out_token_id, self.audio_out_bos_token_id = ids.get(AUDIO_OUT), ids.get(AUDIO_OUT_BOS)
        held = cache_fields(self.reader.index)
        if waveforms == "auto":
            waveforms = "audio_16k" if "audio_16k" in held else "audio"
        if waveforms not in held:
            raise KeyError(f"{self.cache}: no waveform field {waveforms!r} (it has {sorted(held)})")
        self.waveforms = waveforms
        #: Hz of that field (``manifest.json`` ``waveforms``)
        self.rate = int(((manifest.get("waveforms") or {}).get(waveforms) or {}).get("sample_rate")
                        or manifest.get("sample_rate") or 0)
        if speakers is None:
            names = self.reader.index.column("speaker").to_pylist()
            speakers = sorted({s for s in names if s})
        self.speakers = list(speakers)
        self.speaker_ids = {s: i for i, s in enumerate(self.speakers)}
        self.sample_class = sample_class

    def __len__(self) -> int:
        return len(self.reader)

    def _cls(self):
        if self.sample_class is None:
            try:
                from boson_multimodal.dataset.chatml_dataset import ChatMLDatasetSample
            except ImportError as e:
                raise ImportError(f"HiggsChatMLDataset yields boson_multimodal's ChatMLDatasetSample: pip install "
                                  f"boson-multimodal (with its transformers<4.47), or pass sample_class= ({e})") from e
            self.sample_class = ChatMLDatasetSample
        return self.sample_class

    def boson_labels(self, input_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Labels in Boson's convention: ``<|AUDIO_OUT|>`` labelled (its id) where the
        ``<|audio_out_bos|>`` right before it is (a trained turn); unchanged where it already is."""
        labels = labels.astype(np.int64).copy()
        if self.audio_out_token_id is None or self.audio_out_bos_token_id is None:
            return labels
        ph = np.flatnonzero(input_ids == self.audio_out_token_id)
        ph = ph[ph > 0]
        fix = ph[(input_ids[ph - 1] == self.audio_out_bos_token_id) & (labels[ph - 1] != IGNORE_INDEX)]
        labels[fix] = self.audio_out_token_id
        return labels

    def __getitem__(self, i: int):
        s = self.reader.get(int(i))
        key = s["__key__"]
        ids = np.asarray(s["input_ids"], dtype=np.int64)
        labels = self.boson_labels(ids, np.asarray(s["labels"]))
        segs = np.asarray(s.get("audio_segments", np.zeros((0, 6), np.int32)), dtype=np.int64).reshape(-1, 6)
        codes = s.get("codes")
        codes = torch.from_numpy(np.asarray(codes, dtype=np.int64)) if codes is not None \
            else torch.zeros((self.n_codebooks, 0), dtype=torch.long)
        meta = s.get("json") or {}
        names = meta.get("speakers") or []
        spk = [self.speaker_ids.get(names[j], -1) if 0 <= j < len(names) else -1 for j in segs[:, _SPEAKER].tolist()]
        waves, starts, rates = [], [], []
        inputs = np.flatnonzero(segs[:, _DIR] == 0)
        if len(inputs):
            wave = s.get(self.waveforms)
            offs = s.get(f"{self.waveforms}_starts")
            if wave is None or offs is None:
                raise KeyError(f"{self.cache}: sample {key!r} has input audio but no {self.waveforms!r} waveforms")
            rate = self.rate
            at = 0
            for k in inputs.tolist():
                w = WAVEFORM.from_storage(wave[offs[k]:offs[k + 1]])   # int16 PCM -> float32 [-1, 1)
                waves.append(torch.from_numpy(w))
                starts.append(at)
                rates.append(rate)
                at += len(w)
        return self._cls()(
            input_ids=torch.from_numpy(ids),
            label_ids=torch.from_numpy(labels),
            audio_ids_concat=codes,
            audio_ids_start=torch.from_numpy(segs[:, _START].copy()),
            audio_waveforms_concat=torch.cat(waves) if waves else torch.zeros(0, dtype=torch.float32),
            audio_waveforms_start=torch.tensor(starts, dtype=torch.long),
            audio_sample_rate=torch.tensor(rates, dtype=torch.float32),
            audio_speaker_indices=torch.tensor(spk, dtype=torch.long),
        )
