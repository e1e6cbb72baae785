"""Issue 22: why PPO with the oracle critic (sigma 0) breaks the walk's fixed text. One seed, few steps.

History, not maintained: it ran at commit 3a9c9fe (the commit that added it with its logs and JSON) and
subclasses what that commit's trainer and ``benchmarks/known_error_critic.py`` had
(``OracleCriticPPOTrainer``, ``SAEPPOTrainer._update`` / ``_teacher_forced``, ``batch.raw_advantages``),
which later commits renamed or split, so on a later checkout it stops at once with a one-line message. Run
it in a worktree of that commit, from its root:

    git worktree add /tmp/learn-pilots 3a9c9fe && cd /tmp/learn-pilots
    PYTHONPATH=$PWD python benchmarks/results/known_error_critic/learn_pilots/diagnose.py ...

(``commands.md`` next to it has the commands that were run.)

Per PPO step: raw / whitened advantages and the update's log-prob change per token class of the training batch
(decision door, fixed text before the walk failed, the failing token, text after it), and after the step the
held-out samples' first-failure field (which part of the line broke, and what was written there).

    python benchmarks/results/known_error_critic/learn_pilots/diagnose.py --lr 1e-3 --steps 4 --out x.json \
        [--extra '{"whiten_advantages": false}']
"""

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import known_error_critic as kec
import long_horizon as lh

if not hasattr(kec, "OracleCriticPPOTrainer"):
    raise SystemExit(
        "diagnose.py is frozen history: it runs at commit 3a9c9fe, not on this checkout; run it in "
        "`git worktree add /tmp/learn-pilots 3a9c9fe` (see its docstring)."
    )

from trl_sae.demo.decision_task import decision_segmentation, filler

CLASSES = ("decision", "fixed_before_fail", "failing", "after_fail")


def field_of(text: str, fail: int, gap_len: int) -> str:
    line_start = text.rfind("\n", 0, fail) + 1
    line = text[line_start:fail]
    if line.startswith("E") or (line == "" and text[fail] == "E"):
        return "END"
    col = fail - line_start
    names = {0: "step", 1: "dot", 6: "colon", 7: "room", 8: "gt", 9: "door", 10: "space"}
    if col == 7:  # the restated room: on line 1 a copy of the prompt's start room, later of the last "at X"
        return "room_line1" if line_start == 0 else "room_later"
    if col in names:
        return names[col]
    if 2 <= col <= 5:
        return "pass"
    if 11 <= col < 11 + gap_len:
        return "filler"
    if col < 11 + gap_len + 4:
        return "at"
    if col == 11 + gap_len + 4:
        return "restated_door"
    return "newline/eos"


class Diagnosed(kec.OracleCriticPPOTrainer):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.records = []

    def _classes(self, batch):
        B, T = batch.completion_ids.shape
        cls = torch.full((B, T), -1)
        self.fields = {}
        gap = len(filler(8))
        for i in range(B):
            n = int(batch.lengths[i])
            ids = batch.completion_ids[i, :n].tolist()
            text = self.processing_class.decode(ids, skip_special_tokens=True)
            starts = kec._token_starts(self.processing_class, ids)
            c = batch.columns
            scan = kec.scan_walk(
                text,
                c["start"][i],
                c["tag"][i],
                c["doors"][i],
                int(c["num_decisions"][i]),
                int(c["filler_length"][i]),
            )
            for t, s in enumerate(starts):
                if scan.fail is not None and s > scan.fail:
                    cls[i, t] = 3
                elif scan.fail is not None and s == scan.fail:
                    cls[i, t] = 2
                elif s in scan.decisions:
                    cls[i, t] = 0
                else:
                    cls[i, t] = 1
                    if s < len(text):
                        self.fields.setdefault(field_of(text, s, gap), []).append((i, t))
        return cls

    def _update(self, batch):
        cls = self._classes(batch)
        old = batch.logprobs.clone()
        stats = super()._update(batch)
        with torch.no_grad():
            new, _ = self._teacher_forced(
                self.accelerator.unwrap_model(self.model).policy,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
            )
        rec = {
            "step": self.state.global_step + 1,
            "reward": float(batch.scores.mean()),
            "rate": self.oracle_rates[-1],
        }
        for k, name in enumerate(CLASSES):
            m = cls == k
            if not m.any():
                rec[name] = {"n": 0}
                continue
            raw, adv, d = batch.raw_advantages[m], batch.advantages[m], (new - old)[m]
            confident = m & (old.exp() > 0.9)
            rec[name] = {
                "n": int(m.sum()),
                "raw_mean": float(raw.mean()),
                "raw_absmean": float(raw.abs().mean()),
                "white_mean": float(adv.mean()),
                "white_absmean": float(adv.abs().mean()),
                "dlogp_mean": float(d.mean()),
                "n_confident": int(confident.sum()),
                "confident_dlogp_mean": float((new - old)[confident].mean()) if confident.any() else None,
                "confident_frac_below_0.5": float((new[confident].exp() < 0.5).float().mean())
                if confident.any()
                else None,
            }
        rec["fixed_dlogp_by_field"] = {
            f: round(float(sum((new - old)[i, t] for i, t in pos) / len(pos)), 4)
            for f, pos in self.fields.items()
        }
        self.records.append(rec)
        print(json.dumps(rec), flush=True)
        return stats


def failure_fields(policy, tokenizer, test_set, settings):
    res = decision_segmentation(
        policy, tokenizer, test_set, num_samples=2, temperature=settings.temperature, seed=settings.eval_seed
    )
    gap = len(filler(8))
    fields, examples = collections.Counter(), []
    for s, row in zip(res["samples"], [test_set[i] for i in range(len(test_set)) for _ in range(2)]):
        text = tokenizer.decode(s["ids"], skip_special_tokens=True)
        scan = kec.scan_walk(text, row["start"], row["tag"], row["doors"], int(row["num_decisions"]), 8)
        if scan.fail is None:
            fields["ok" if s["reward"] else "unfinished"] += 1
            continue
        f = "forbidden_door" if scan.violations else field_of(text, scan.fail, gap)
        fields[f] += 1
        if f != "forbidden_door" and len(examples) < 6:
            ls = text.rfind("\n", 0, scan.fail) + 1
            examples.append(f"{f}: ...{text[max(0, ls - 30) : scan.fail + 6]!r} (fail at {scan.fail - ls})")
    return {"success": res["success"], "fields": dict(fields), "examples": examples}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--estimator", default="sae")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", type=json.loads, default={})
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback, TrainerCallback

    from trl_sae import SAEPPOConfig
    from trl_sae.demo.decision_task import walk_reward
    from trl_sae.demo.tiny import build_char_tokenizer

    settings = kec.default_settings()
    tok = build_char_tokenizer()
    splits = lh.make_splits(settings, 8)
    warm_dir, _ = lh.build_warm_start(settings, 8, splits, tok, Path.home() / ".cache/trl-sae/long_horizon")
    test_set = splits["test"].select(range(50))
    fields = {
        "output_dir": tempfile.mkdtemp(),
        "per_device_train_batch_size": settings.batch_size,
        "num_generations": settings.num_generations,
        "max_steps": a.steps,
        "response_length": settings.response_length(8),
        "temperature": settings.temperature,
        "learning_rate": a.lr,
        "critic_learning_rate": settings.critic_learning_rate,
        "lr_scheduler_type": "constant",
        "num_ppo_epochs": settings.num_ppo_epochs,
        "num_mini_batches": settings.num_mini_batches,
        "segment_threshold": settings.segment_threshold,
        "lam": settings.lam,
        "seed": a.seed,
        "report_to": "none",
        "disable_tqdm": True,
        "save_strategy": "no",
        "use_cpu": True,
        "advantage_estimator": a.estimator,
        **a.extra,
    }
    tr = Diagnosed(
        model=AutoModelForCausalLM.from_pretrained(warm_dir),
        reward_funcs=walk_reward,
        args=SAEPPOConfig(**fields),
        train_dataset=splits["train"].remove_columns(["solution", "solution_is_correct"]),
        processing_class=tok,
        sigma=0.0,
        noise_seed=a.seed,
    )
    tr.remove_callback(PrinterCallback)
    policy = tr.accelerator.unwrap_model(tr.model).policy
    evals = [{"step": 0, **failure_fields(policy, tok, test_set, settings)}]
    print(json.dumps(evals[-1]), flush=True)

    class Eval(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            evals.append({"step": state.global_step, **failure_fields(policy, tok, test_set, settings)})
            print(json.dumps(evals[-1]), flush=True)

    tr.add_callback(Eval())
    tr.train()
    a.out.write_text(
        json.dumps({"args": vars(a) | {"out": str(a.out)}, "steps": tr.records, "evals": evals}, indent=1)
    )


if __name__ == "__main__":
    main()
