"""The Higgs-Audio / HF Trainer launch line, translated into ``shardcache train`` flags.

Boson's multi-node recipe launches ``torchrun ... train.py --model_path P --train_data_file F
--output_dir D --bf16 --use_lora ...``; :func:`translate` turns those spellings into this project's
options before parsing, so that line works as written (after ``-m shardcache train``). Nothing else
knows these names. ``--model_path P`` sets ``model.kwargs.lm = P`` (last, so a ``--model.kwargs`` mapping on
the line, which replaces the file's, keeps it) and, unless the line names a model, ``--model.name higgs`` with
the config file's ``model.kwargs`` dropped (they belong to the file's model).
"""
from __future__ import annotations

from shardcache.config import ConfigError

#: Higgs-Audio flags that take a value -> the option they set
VALUE_FLAGS = {
    "--train_data_file": "--data.cache", "--output_dir": "--job.dir", "--save_steps": "--checkpoint.every",
    "--per_device_train_batch_size": "--data.batch_size", "--learning_rate": "--optim.lr",
    "--num_train_epochs": "--training.epochs", "--logging_steps": "--metrics.every",
    "--warmup_steps": "--schedule.warmup_steps", "--audio_tokenizer_path": "--model.audio_tokenizer",
}
#: Higgs-Audio switches -> the flags they stand for
SWITCHES = {"--bf16": ["--training.precision", "bf16"], "--disable_evaluation": ["--eval.enabled", "false"],
            "--use_lora": ["--lora.enabled", "true"]}


def translate(argv: list[str]) -> list[str]:
    """``argv`` with the Higgs-Audio spellings replaced (``--flag VALUE`` and ``--flag=VALUE``);
    other arguments are kept in order. Raises :class:`ConfigError` for ``--model_path`` with the
    reference model (it loads no LM)."""
    out: list[str] = []
    last: list[str] = []
    it = iter(argv)
    named = next((a.partition("=")[2] if "=" in a else (argv[i + 1:] or [""])[0]
                  for i, a in enumerate(argv) if a.partition("=")[0] == "--model.name"), None)
    for tok in it:
        name, eq, val = tok.partition("=")
        if name in SWITCHES:
            out += SWITCHES[name]
        elif name in VALUE_FLAGS:
            out += [VALUE_FLAGS[name], val if eq else next(it, "")]
        elif name == "--model_path":
            path = val if eq else next(it, "")
            if named == "reference":
                raise ConfigError([("--model_path", "the reference model loads no LM; use --model.name "
                                                    "higgs|tts|vlm|module:factory")])
            out += [] if named is not None else ["--model.name", "higgs", "--model.kwargs", "{}"]
            last = ["--model.kwargs.lm", path]
        else:
            out.append(tok)
    return out + last
