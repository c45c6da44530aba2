"""`labkit checkpoint import-hf HF_DIR --spec SPEC -o CKPT_DIR` and `labkit checkpoint export-hf CKPT_DIR --spec SPEC
-o HF_DIR`: Hugging Face checkpoints in and out of labkit's driver (labkit.checkpoint.hf)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    ckpt = sub.add_parser("checkpoint", help="convert checkpoints to and from Hugging Face transformers")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", metavar="COMMAND")
    p = ckpt_sub.add_parser("import-hf", help="a Hugging Face Llama or GPT-2 model -> a checkpoint train.load reads",
                            description="Write a transformers model directory (config.json, *.safetensors) as a "
                                        "torch_dist release checkpoint for the spec's model, loadable under any "
                                        "pipeline layout and any tensor size that pads the vocabulary as the spec's "
                                        "parallel.tensor does (train.load, train.ckpt_format torch_dist).")
    p.add_argument("source", metavar="HF_DIR", help="directory save_pretrained wrote")
    p.add_argument("--spec", required=True, help="run spec whose model matches the HF config")
    p.add_argument("-o", "--output", required=True, metavar="CKPT_DIR", help="new checkpoint directory")
    p.set_defaults(func=lambda args: _convert(args, "import-hf"))
    e = ckpt_sub.add_parser("export-hf", help="a torch_dist checkpoint -> a Hugging Face model directory",
                            description="Write the latest iteration (or release) of a torch_dist checkpoint as "
                                        "config.json and model.safetensors, which transformers' "
                                        "AutoModelForCausalLM loads.")
    e.add_argument("source", metavar="CKPT_DIR", help="directory train.save wrote, or import-hf")
    e.add_argument("--spec", required=True, help="run spec whose model the checkpoint holds")
    e.add_argument("-o", "--output", required=True, metavar="HF_DIR", help="new HF model directory")
    e.set_defaults(func=lambda args: _convert(args, "export-hf"))
    ckpt.set_defaults(func=lambda args: (ckpt.print_help(), 1)[1])


def _convert(args, command: str) -> int:
    import warnings

    # megatron-core's notices that Transformer Engine and Apex are absent, printed as the model is built: nothing a
    # conversion changes
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex)", category=UserWarning)
    from labkit.checkpoint.hf import HFCheckpointError, export_hf, import_hf
    from labkit.extras import MissingExtra
    from labkit.spec import SpecError, load_spec
    from labkit.spec.errors import print_spec_errors

    try:
        spec = load_spec(args.spec)
        if command == "import-hf":
            notes = import_hf(args.source, spec, args.output)
        else:
            export_hf(args.source, spec, args.output)
            notes = []
    except SpecError as exc:
        return print_spec_errors(args.spec, exc)
    except HFCheckpointError as exc:
        if len(exc.problems) == 1:
            print(f"labkit checkpoint {command}: {exc.problems[0]}", file=sys.stderr)
        else:
            print(f"labkit checkpoint {command}: {len(exc.problems)} error(s)", file=sys.stderr)
            for problem in exc.problems:
                print(f"  - {problem}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        print(f"labkit checkpoint {command}: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    print(f"wrote {args.output}")
    return 0
