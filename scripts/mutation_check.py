"""Mutation check of the trainer's tests: apply one mutation (a feature removed) at a time, run the
test that must catch it, restore the file. Every line of the output should say CAUGHT.

    .venv/bin/python scripts/mutation_check.py [NAME-SUBSTRING ...]

Run on a clean work tree (each file is written back as it was read).
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
M = [
 ("autocast -> null context", "train/precision.py", "        if self.dtype is None:\n            return contextlib.nullcontext()",
  "        if True:\n            return contextlib.nullcontext()", ["tests/test_train_features.py::test_autocast_runs_the_forward_matmuls_in_the_configured_dtype"]),
 ("activation checkpointing no-op", "train/recipes/reference.py", "if self.activation_checkpointing and self.training:", "if False:",
  ["tests/test_train_features.py::test_activation_checkpointing_recomputes_the_blocks_in_backward"]),
 ("sampler split by local rank", "train/data.py", "global_rank=info.rank,", "global_rank=info.local_rank,",
  ["tests/test_train_multinode.py"]),
 ("rank-0 gating by local rank", "train/dist.py", "        return self.rank == 0", "        return self.local_rank == 0",
  ["tests/test_train_multinode.py"]),
 ("DDP without bucket-view gradients", "train/trainer.py", "kw: dict[str, Any] = dict(gradient_as_bucket_view=True,", "kw: dict[str, Any] = dict(gradient_as_bucket_view=False,",
  ["tests/test_train_ddp.py::test_ddp_settings_and_fused_adamw"]),
 ("fused AdamW never selected", "train/optim.py", 'fused = o.fused == "on" or (o.fused == "auto" and fused_adamw_supported(device))', "fused = False",
  ["tests/test_train_features.py::test_fused_adamw_selection"]),
 ("second audio open through libsndfile", "precompute/audio.py", "                    _sf_windows(f, label, spans, results, sample_rates, **kw)",
  "                    sf.info(str(path))\n                    _sf_windows(f, label, spans, results, sample_rates, **kw)",
  ["tests/test_precompute_demo.py::test_each_audio_file_opened_exactly_once"]),
 ("compact batches not widened on the device", "loaders/device.py", "                v = f.kind.to_model(f, v)", "                pass",
  ["tests/test_train_unit.py::test_run_writes_metrics_checkpoints_and_validation"]),
 ("host sync every step", "train/trainer.py", "            self.stats.add_micro(loss, extras, count_tokens(batch), n_samples(batch))",
  "            float(loss)\n            self.stats.add_micro(loss, extras, count_tokens(batch), n_samples(batch))",
  ["tests/test_train_features.py::test_no_host_sync_between_log_steps"]),
 ("fp16 without GradScaler", "train/precision.py", 'scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None', "scaler = None",
  ["tests/test_train_features.py::test_fp16_with_grad_scaler_trains_the_reference_model_on_cpu"]),
 ("non-finite limit ignored", "train/trainer.py", "        check_nonfinite(streak, limit, self.state.step)", "        check_nonfinite(0, limit, self.state.step)",
  ["tests/test_train_features.py::test_all_nan_run_exits_1_without_a_checkpoint"]),
 ("damaged checkpoint not skipped", "train/checkpoint.py", "            check_readable(p)\n        except CheckpointDamaged as e:", "            pass\n        except CheckpointDamaged as e:",
  ["tests/test_train_features.py::test_damaged_newest_checkpoint_is_named_and_the_previous_one_used"]),
 ("LoRA checkpoint saves full weights", "train/trainer.py", "adapter=adapter_info(cfg, self.raw, self.spec),", "adapter=None,",
  ["tests/test_train_lora.py::test_lora_checkpoint_holds_the_adapter_only_and_resumes_bitwise"]),
 ("checkpoint keeps the live loader state (prefetcher ahead)", "train/trainer.py",
  'loader_state=self.data.state["loader"]', "loader_state=self.loader.state_dict()",
  ["tests/test_train_unit.py::test_resume_bitwise_with_real_loader"]),
 ("schedule polynomial = linear", "train/optim.py", "            decay = (1.0 - frac) ** self.power", "            decay = 1.0 - frac",
  ["tests/test_train_unit.py::test_lr_schedule"]),
 ("contract ignores the codec's weights", "shards/cache.py", 'weights=_sourced(enc), dtype=enc.get("dtype"), '
  'tf32=self._tf32(enc))\n\n    @property\n    def text_tokenizer', 'weights=None, dtype=enc.get("dtype"), tf32=self._tf32(enc))'
  '\n\n    @property\n    def text_tokenizer',
  ["tests/test_contract_identity.py::test_codes_of_a_codec_of_other_weights_are_refused_and_train_when_asked"]),
 ("LoRA options not compared", "train/trainer.py", "            C.check_adapter(path, lora, what)", "            pass",
  ["tests/test_contract_identity.py::test_lora_adapters_of_another_rank_or_alpha_are_refused"]),
 ("a checkpoint without tokenizer means any", "train/recipes/base.py", "        return None, Unknown(",
  "        return None, None and Unknown(",
  ["tests/test_contract_identity.py::test_a_checkpoint_without_tokenizer_files_needs_its_tokenizer_named"]),
]
only = sys.argv[1:] 
res = []
for name, f, old, new, tests in M:
    if only and not any(o in name for o in only):
        continue
    p = ROOT / f
    src = p.read_text()
    n = src.count(old)
    if n != 1:
        res.append((name, f"PATTERN COUNT {n}")); print(name, "pattern count", n, flush=True); continue
    p.write_text(src.replace(old, new))
    try:
        r = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
        verdict = "CAUGHT" if r.returncode != 0 else "MISSED"
    except subprocess.TimeoutExpired:
        verdict, last = "TIMEOUT(caught?)", ""
    finally:
        p.write_text(src)
    res.append((name, verdict, last)); print(name, verdict, last, flush=True)
print(json.dumps(res, indent=1))
