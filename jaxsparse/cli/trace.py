"""`jaxsparse trace`: record a decode or prefill indexer trace of a text with the real model."""
from __future__ import annotations

from ._common import (FORMATTER, MODEL_CONTEXT, MODEL_LAYERS, CliError, check_out, check_text,
                      fill_defaults, indexers_path, int_list, load_indexers, positive,
                      reject_given)

__all__ = ["HELP", "add_parser", "run"]

HELP = """\
Record an indexer trace of a text file with the real model and trained indexers (the shipped
ones by default): decode (teacher-forced steps, optionally R verifier rows) or prefill.

examples:
  jaxsparse trace decode --text book.txt --prompt-len 3584 --steps 512 --out d.npz
  jaxsparse trace prefill --text book.txt --tokens 8192 --layers 5,15 --out p.npz
"""

DECODE = {"prompt_len": 3584, "steps": 512, "rows": 1}
PREFILL = {"tokens": 4096}


def add_parser(sub) -> None:
  """Register the command on the top-level parser's subparsers."""
  t = sub.add_parser("trace", help="record a decode or prefill trace of a text file",
                     description=HELP, formatter_class=FORMATTER)
  t.add_argument("kind", choices=("decode", "prefill"))
  t.add_argument("--text", required=True, help="UTF-8 text file")
  t.add_argument("--indexers", default="", help="indexers.npz or a training --out folder "
                 "(default: the shipped indexers)")
  t.add_argument("--out", required=True, help="trace .npz to write")
  t.add_argument("--layers", type=int_list("--layers", low=0), default=None,
                 help=f"comma list of model layer ids (default: all {MODEL_LAYERS})")
  t.add_argument("--prompt-len", type=positive("--prompt-len"), default=None,
                 help=f"decode: slots before step 0 (default {DECODE['prompt_len']})")
  t.add_argument("--steps", type=positive("--steps"), default=None,
                 help=f"decode: steps (default {DECODE['steps']})")
  t.add_argument("--rows", type=positive("--rows"), default=None,
                 help=f"decode: verifier rows, R = drafts + 1 (default {DECODE['rows']})")
  t.add_argument("--tokens", type=positive("--tokens"), default=None,
                 help=f"prefill: tokens (default {PREFILL['tokens']})")
  t.set_defaults(func=run)


def run(args) -> int:
  mine, other = (DECODE, PREFILL) if args.kind == "decode" else (PREFILL, DECODE)
  reject_given(args, other, f"to a {args.kind} trace")
  fill_defaults(args, mine)
  layers = None
  if args.layers:
    bad = [v for v in args.layers if not 0 <= v < MODEL_LAYERS]
    if bad:
      raise CliError(f"--layers: {bad} out of range; the model has layers 0..{MODEL_LAYERS - 1}")
    layers = args.layers
  need = (args.prompt_len + args.steps + args.rows - 1 if args.kind == "decode"
          else args.tokens)
  if need > MODEL_CONTEXT:
    given = (f"--prompt-len={args.prompt_len} + --steps={args.steps} + --rows={args.rows} - 1 "
             f"= {need:,} tokens exceed" if args.kind == "decode" else f"--tokens={need} exceeds")
    raise CliError(f"{given} the model's {MODEL_CONTEXT:,}-token context")
  check_out("--out", args.out, (".npz",))
  s = check_text("--text", args.text)
  ipath = indexers_path("--indexers", args.indexers)
  idx = load_indexers("--indexers", ipath)
  from jaxsparse.model import gguf_weights
  ids = gguf_weights.tokenizer().encode(s).ids
  if len(ids) < need:
    raise CliError(f"--text={args.text!r} has {len(ids):,} tokens; this trace needs {need:,}")
  from jaxsparse import traces
  from jaxsparse.model import llama, record
  from rich.console import Console
  with Console(stderr=True).status(f"recording a {args.kind} trace ({need:,} tokens)"):
    base = llama.load_model()
    if args.kind == "decode":
      tr = record.record_decode(base, idx, ids, prompt_len=args.prompt_len, steps=args.steps,
                                rows=args.rows, layers=layers, source=args.text)
    else:
      tr = record.record_prefill(base, idx, ids[: args.tokens], layers=layers,
                                 source=args.text)
    traces.save(args.out, tr)
  print(f"wrote {args.out} ({tr.kind}, layers {tr.layers.tolist()}, q {tr.q.shape})")
  return 0
