"""The int8 draft against the bf16 draft on the shipped default pair: acceptance α and the draft's cost c.

Same target (bf16), same prompts (the shipped held-out set), same fixed τ, greedy: the outputs must be identical
(checked); what may differ is how many drafted tokens the target accepts (α = accepted / drafted) and what a draft
pass costs (t_draft(1), measured by ``specdec.real_shapes.pass_times`` in the same process, and c = t_draft(1) /
t_target(1)).

    python benchmarks/int8_draft.py                      # 8 prompts, τ = 4, 64 new tokens
    python benchmarks/int8_draft.py --n-prompts 16 --tau 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--tau", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import specdec
    from specdec import real_shapes as rs
    from specdec.runtime import native_kernel as nk

    data = Path(specdec.__file__).parent / "data" / "heldout_prompts.jsonl"
    prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()[: args.n_prompts]]
    engines = {name: specdec.load(dtype="bf16", draft_dtype=name) for name in ("bf16", "int8")}
    target = engines["bf16"].target
    t_target = rs.pass_times(target, [1], batches=False).block[1]
    out: dict[str, dict[str, float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, eng in engines.items():
        drafted = accepted = 0
        outputs[name] = []
        for p in prompts:
            r = eng.generate(p, max_new_tokens=args.max_new_tokens, tau=args.tau)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
            outputs[name].append(r.token_ids)
        assert eng.drafter is not None
        t_draft = rs.pass_times(eng.drafter.runner, [1], batches=False).block[1]
        out[name] = {"alpha": accepted / max(drafted, 1), "t_draft_s": t_draft, "c": t_draft / t_target}
    same = outputs["bf16"] == outputs["int8"]
    result = {"kernel": nk.kernel_status(), "tau": args.tau, "prompts": len(prompts), "t_target_s": t_target}
    result.update(drafts=out, identical_outputs=same)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if not same:
        raise SystemExit("outputs differ between the bf16 and the int8 draft: a bug (the draft must not change them)")


if __name__ == "__main__":
    main()
