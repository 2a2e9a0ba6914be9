"""Options shared by every command that loads models, parsed into one settings object."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.engine import Engine
from specdec.errors import InvalidRequestError


@dataclass
class ModelSettings:
    target: Path | None
    draft: Path | None
    prompt_lookup: bool
    no_draft: bool
    device: str
    dtype: str
    draft_dtype: str | None
    runtime: str
    policy: str | None  # a policy spec; None: the fixed policy
    tau: int | None  # shorthand for fixed:tau=N (an error beside another policy)
    trust_remote_code: bool
    compile: bool = False
    draft_tokenizer: str = "auto"  # auto | shared | bridge (a draft with a tokenizer of its own)
    draft_vocab: str = "auto"  # auto | full | N: the tokens the draft's output head keeps (specdec.draft_vocab)
    draft_window: str = "auto"  # auto | full | N: the latest tokens the draft attends to (specdec.draft_window)
    kv_dtype: str = "auto"  # auto | fp32 | bf16 | fp16: the KV caches' element type on the CPU kernel
    prefix_cache: str = "off"  # auto | off | MiB: finished requests' keys and values kept by prefix (serve: auto)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSettings:
        return cls(
            target=args.target,
            draft=args.draft,
            prompt_lookup=args.prompt_lookup,
            no_draft=args.no_draft,
            device=args.device,
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            runtime=args.runtime,
            policy=args.policy,
            tau=args.tau,
            trust_remote_code=args.trust_remote_code,
            compile=getattr(args, "compile", False),
            draft_tokenizer=getattr(args, "draft_tokenizer", "auto"),
            draft_vocab=getattr(args, "draft_vocab", "auto"),
            draft_window=getattr(args, "draft_window", "auto"),
            kv_dtype=getattr(args, "kv_dtype", "auto"),
            prefix_cache=getattr(args, "prefix_cache", "off"),
        )

    def load(self, observers: list | None = None) -> Engine:
        from specdec.api import default_draft, default_target, load

        target, draft = self.target, self.draft
        if target is None and draft is None and not (self.prompt_lookup or self.no_draft):
            draft = default_draft()
        if self.no_draft:
            draft = None
        return load(
            target or default_target(),
            draft,
            prompt_lookup=self.prompt_lookup and not self.no_draft,
            device=self.device,
            dtype=self.dtype,
            draft_dtype=self.draft_dtype,
            runtime=self.runtime,
            policy=self.policy,
            tau=self.tau,
            observers=observers,
            trust_remote_code=self.trust_remote_code,
            compile=self.compile,
            draft_tokenizer=self.draft_tokenizer,
            draft_vocab=self.draft_vocab,
            draft_window=self.draft_window,
            kv_dtype=self.kv_dtype,
            prefix_cache=self.prefix_cache,
        )


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", type=Path, default=None, help="target checkpoint directory (default: the shipped pair)")
    g.add_argument("--draft", type=Path, default=None, help="draft checkpoint directory")
    add_draft_tokenizer_arg(g)
    g.add_argument(
        "--prompt-lookup", action="store_true", help="draft by n-gram lookup in the context (no draft model)"
    )
    g.add_argument("--no-draft", action="store_true", help="plain target decoding (with the default target)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto, float32 or bfloat16 (auto: bf16 on CUDA, on CPUs with bf16 units and for the native runtime; fp32 for transformers elsewhere)",
    )
    g.add_argument("--draft-dtype", default=None, help="dtype of the draft model (default: as --dtype)")
    add_draft_vocab_arg(g)
    add_draft_window_arg(g)
    add_kv_dtype_arg(g)
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each native-runtime model's decode/verify step per block size (slow start; see docs/runtime.md)",
    )
    g.add_argument("--runtime", default="auto", help="auto, native or hf (auto: native for Llama-family checkpoints)")
    g.add_argument(
        "--policy",
        default=None,
        help="how τ is chosen each step: fixed, heuristic, confidence, adaptive, or with settings "
        "NAME:KEY=VALUE,... e.g. adaptive:max_tau=8 (default: fixed:tau=4)",
    )
    g.add_argument(
        "--tau",
        type=int,
        default=None,
        help="draft tokens per step: shorthand for --policy fixed:tau=N (with another policy, set its own "
        "bound instead, e.g. adaptive:max_tau=N; default: 4)",
    )
    g.add_argument("--trust-remote-code", action="store_true", help="allow checkpoints with custom Python code")


def add_kv_dtype_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--kv-dtype",
        default="auto",
        metavar="auto|fp32|bf16|fp16",
        help="element type of the models' KV caches on the CPU kernel: auto (16 bits for 16-bit weights, fp32 for "
        "fp32 weights), fp32, bf16 or fp16; a 16-bit cache halves the bytes attention reads (default: auto)",
    )


def add_draft_vocab_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--draft-vocab",
        default="auto",
        metavar="N|full|auto",
        help="tokens the draft's output head computes: its N most frequent (from the draft's token_ranking.json; "
        "the output never changes, only acceptance), full, or auto (the draft's own default where it runs on the "
        "CPU kernel: 4096 for the shipped draft; default: auto)",
    )


def add_draft_window_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--draft-window",
        default="auto",
        metavar="N|full|auto",
        help="how many of the latest tokens the draft attends to: N, full, or auto (the length the draft was "
        "trained on, from its specdec_training.json: 256 for the shipped draft; else full). The output never "
        "changes, only acceptance and the draft's cost; native runtime (default: auto)",
    )


def add_draft_tokenizer_arg(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--draft-tokenizer",
        choices=("auto", "shared", "bridge"),
        default="auto",
        help="a draft with a tokenizer of its own: auto drafts through text when it differs from the target's "
        "(said on stderr; see docs/models.md), shared refuses such a draft, bridge drafts through text always",
    )


def add_logits_rule_args(g: argparse._ActionsContainer) -> None:
    """The request's logits rules (``specdec.logits_rules``): penalties, bias, min_tokens, ignore_eos."""
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style repetition penalty, > 0 (1 = off)")
    g.add_argument(
        "--logit-bias",
        action="append",
        default=None,
        type=_logit_bias,
        metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )
    g.add_argument("--min-tokens", type=int, default=0, help="EOS is not generated before this many tokens")
    g.add_argument("--ignore-eos", action="store_true", help="EOS does not end generation (fixed-length output)")


def logits_rule_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``Engine.start`` keyword arguments of the flags ``add_logits_rule_args`` adds."""
    return dict(
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=dict(args.logit_bias or []),
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
    )


def add_format_args(g: argparse._ActionsContainer) -> None:
    """The output's format (``specdec.output_format``): one of these flags."""
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    x.add_argument("--json-schema", metavar="FILE|JSON", help="the output is JSON of this schema (a file or the text)")
    x.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    x.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these texts (repeatable)")
    x.add_argument("--grammar", metavar="FILE", type=Path, help="the output follows this Lark grammar")


def format_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``Engine.start``'s ``response_format`` from the flags ``add_format_args`` adds (absent: none)."""
    spec: dict[str, Any] | None = None
    if args.json_object:
        spec = {"type": "json_object"}
    elif args.json_schema is not None:
        path = Path(args.json_schema).expanduser()
        if not path.is_file() and path.suffix == ".json":
            raise InvalidRequestError(f"--json-schema: no such file: {args.json_schema}", "json_schema")
        text = _read_text(path, "--json-schema") if path.is_file() else args.json_schema
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            where = str(path) if path.is_file() else "the value"
            raise InvalidRequestError(
                f"--json-schema: {where} is not JSON ({e}); give a schema file or the schema's text", "json_schema"
            ) from e
        spec = {"type": "json_schema", "json_schema": {"schema": schema}}
    elif args.regex is not None:
        spec = {"type": "regex", "regex": args.regex}
    elif args.choice is not None:
        spec = {"type": "choice", "choice": args.choice}
    elif args.grammar is not None:
        spec = {"type": "grammar", "grammar": _read_text(args.grammar, "--grammar")}
    return {"response_format": spec} if spec is not None else {}


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"{flag} {path}: cannot read it: {e}", flag.lstrip("-").replace("-", "_")) from e


def _logit_bias(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 50256=-100), got {value!r}") from None
