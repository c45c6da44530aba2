"""The shape of the house: labkit's imports form no cycle, and each concept has one home.

Imports are read from the source (function-level imports included: a deferred import hides a cycle, it does not remove
it). A concept's home is found by what its code must contain, so that a second copy under another name is caught too.
"""
import ast
import graphlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at module level, in functions, not under TYPE_CHECKING)."""
    known = modules(root)

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        targets = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if node.module else anchor
                # `from package import sub` depends on the submodule when there is one, else on the package
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        graph[name] = {owner(t) for t in targets if t.split(".")[0] == root.name and owner(t)} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


def test_labkit_imports_have_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded to labkit's packages (labkit.estimate.params -> labkit.estimate); a top-level module
    stays itself."""
    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    folded: dict[str, set[str]] = {}
    for module, deps in graph.items():
        folded.setdefault(package(module), set()).update(package(d) for d in deps)
    return {name: deps - {name} for name, deps in folded.items()}


def test_labkit_packages_have_no_cycle():
    """No loop between packages either: a package that needs a helper of another either sits above it or the helper
    moves down (the tokenizers, the model's shape and its FLOPs live in labkit.megatron for the spec and the driver)."""
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_the_package_cycle_check_sees_a_loop_between_packages():
    graph = {"labkit.spec.load": {"labkit.train.tokenizer"}, "labkit.train.training": {"labkit.estimate.flops"},
             "labkit.estimate.params": {"labkit.spec"}, "labkit.train.tokenizer": set()}
    assert find_cycle(graph) is None  # no module loop: only the packages go round
    assert set(find_cycle(package_graph(graph))) == {"labkit.spec", "labkit.train", "labkit.estimate"}


def test_the_cycle_check_sees_a_deferred_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import g\n")
    (package / "b.py").write_text("def g():\n    from pkg import a\n")
    assert set(find_cycle(import_graph(package))) == {"pkg.a", "pkg.b"}


# Data flows one way: a module imports only from its own layer or the layers before it. Command-line modules sit on
# top (each registers its subcommands and may use anything).
LAYERS = (
    ("labkit.paths", "labkit.net", "labkit.extras", "labkit.messages"),
    # Megatron's own rules (labkit.megatron.sizes), beneath everything that speaks Megatron.
    ("labkit.megatron",),
    ("labkit.catalog",),
    # The spec's own flags (megatron_args reads a spec's values only), which job.extra_args must not repeat, and the
    # DeepSpeed config beside them.
    ("labkit.megatron_args", "labkit.deepspeed_config"),
    ("labkit.spec",),
    ("labkit.estimate", "labkit.logs", "labkit.train", "labkit.data_prep", "labkit.profiling",
     "labkit.exercises"),
    ("labkit.plan", "labkit.diagrams"),
    ("labkit.jobs",),
    ("labkit.lab", "labkit.cli", "labkit.completion", "labkit.__main__", "labkit"),
)


def layer_of(module: str) -> int:
    if module.endswith((".cli", ".__main__")):
        return len(LAYERS) - 1
    matches = [(len(prefix), i) for i, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} belongs to no layer: add it to LAYERS"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def test_imports_point_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    assert upward_imports({"labkit.logs.views": {"labkit.jobs.record"}}) == ["labkit.logs.views -> labkit.jobs.record"]


# Each concept, the one module allowed to hold it, and what its code must contain.
HOMES = {
    "repository-root computation": ("labkit/paths.py", re.compile(r"__file__|resources\.files\(")),
    "free-port helper": ("labkit/net.py", re.compile(r"\.bind\(\(\s*['\"][^'\"]*['\"]\s*,\s*0\s*\)\)")),
    "iteration-line parser": ("labkit/logs/parse.py", re.compile(r"re\.compile\([^\n]*iteration[^\n]*\(\\d[+{]")),
    "pipeline simulator": ("labkit/estimate/timing.py",
                           re.compile(r"def \w*(1f1b|interleav|simulate_pipeline|play_schedule)\w*\(")),
    "rank-order mapping": ("labkit/spec/layout.py", re.compile(r"def \w*(rank_order|rank_to_stage|stage_ranks)\w*\(")),
    # Megatron's derived sizes: a world divided by tensor (x context) x pipeline, the SwiGLU MLP width (or a 4h
    # fallback written as `ffn_hidden_size or ...`), the vocabulary rounded up to its padding multiple.
    "data-parallel size": ("labkit/megatron/sizes.py",
                           re.compile(r"\bworld\w*\s*//|//\s*(max\(1,\s*)?\((?:[\w.]*\.)?(tp|tensor\w*|t)\s*\*")),
    "MLP width default": ("labkit/megatron/sizes.py",
                          re.compile(r"4\s*\*\s*[\w.]+\s*\*\s*2\s*/\s*3|8\s*\*\s*[\w.]+\s*//?\s*\(?\s*(3|192)\b"
                                     r"|ffn_hidden_size\s+or\b")),
    "padded vocabulary": ("labkit/megatron/sizes.py", re.compile(r"-\(-\s*[\w.]*vocab\w*\s*//|ceil\([^)\n]*vocab")),
    # Which implementation shards (distributed optimizer, FSDP2, Megatron-FSDP, DeepSpeed): decided from the backend
    # and the entrypoint in one place; everything else asks labkit.megatron.sharding.
    "sharding decision": ("labkit/megatron/sharding.py",
                          re.compile(r"zero_backend\s*[!=]=|[!=]=\s*['\"]deepspeed['\"]|in \(2, 3\) and [\w.]*zero_backend")),
}


def homes_of(pattern: re.Pattern) -> list[str]:
    root = PACKAGE.parent
    return sorted(str(p.relative_to(root)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text()))


@pytest.mark.parametrize("concept", HOMES)
def test_each_concept_has_one_home(concept):
    home, pattern = HOMES[concept]
    assert homes_of(pattern) == [home], f"the {concept} belongs in {home} only"


def test_the_home_check_sees_a_second_copy(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text("import socket\ns = socket.socket()\ns.bind(('', 0))\n")
    assert HOMES["free-port helper"][1].search(copy.read_text())
    assert HOMES["sharding decision"][1].search("fsdp = opt.zero_stage in (2, 3) and opt.zero_backend == 'megatron'")


def test_tests_and_benchmarks_take_free_ports_from_labkit_net():
    pattern = HOMES["free-port helper"][1]
    here = Path(__file__).resolve()
    copies = [str(p.relative_to(PACKAGE.parent)) for folder in ("tests", "benchmarks")
              for p in (PACKAGE.parent / folder).rglob("*.py") if p != here and pattern.search(p.read_text())]
    assert copies == []


RULES = PACKAGE / "megatron" / "rules.py"


def rule_phrases(source: str) -> set[str]:
    """The literal text of each Problem's message in labkit.megatron.rules (pieces of 40 characters or more): a rule
    written a second time elsewhere carries its words along."""
    phrases = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Problem" and len(node.args) > 1:
            for part in ast.walk(node.args[1]):
                if isinstance(part, ast.Constant) and isinstance(part.value, str) and len(part.value.strip()) >= 40:
                    phrases.add(part.value.strip())
    return phrases


def string_text(source: str) -> str:
    """Every string literal of the source, adjacent ones joined as Python joins them, one per line."""
    return "\n".join(part.value for part in ast.walk(ast.parse(source))
                     if isinstance(part, ast.Constant) and isinstance(part.value, str))


def copies_of_rules(files: list[Path]) -> list[str]:
    phrases = rule_phrases(RULES.read_text())
    texts = {path: string_text(path.read_text()) for path in files if path != RULES}
    return sorted(f"{path.name}: {phrase}" for path, text in texts.items() for phrase in phrases if phrase in text)


def test_each_megatron_rule_is_written_once():
    assert len(rule_phrases(RULES.read_text())) > 20
    assert copies_of_rules(list(PACKAGE.rglob("*.py"))) == []


def test_the_rule_check_sees_a_second_copy(tmp_path):
    copy = tmp_path / "checks.py"
    copy.write_text('if spec.optimizer.name != "adam" and spec.optimizer.distributed:\n'
                    '    errors.append("optimizer.distributed: megatron-core\'s distributed optimizer steps Adam only; "\n'
                    '                  "use optimizer.name adam")\n'.replace("\\'", "'"))
    assert copies_of_rules([copy])


@pytest.mark.parametrize("concept, copy", [
    ("data-parallel size", "args.data_parallel_size = world_size // (tp * cp * pp)"),
    ("data-parallel size", "data = max(1, trace.world_size // max(1, tensor * pipeline))"),
    ("data-parallel size", "parallel = {'data': gpus // (t * p * c)}"),
    ("MLP width default", "ffn = int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * h"),
    ("MLP width default", "return self.ffn_hidden_size or 4 * self.hidden_size"),
    ("padded vocabulary", "return -(-vocab_size // multiple) * multiple"),
])
def test_the_home_check_sees_a_copy_of_a_megatron_size(concept, copy):
    assert HOMES[concept][1].search(copy)


def megatron_flag_literals(source: str) -> list[str]:
    """String constants in Python source that are exactly a Megatron-LM flag labkit writes or reads."""
    from labkit.megatron.flags import FLAGS

    names = {flag.name for flag in FLAGS}
    return sorted({node.value for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and node.value in names})


def test_megatron_flags_are_spelled_only_in_their_table():
    """labkit.megatron.flags is the one place a Megatron flag is written as a string; the rest name it as
    FLAG.<name> (messages that mention a flag are not flags)."""
    spelled = {str(p.relative_to(PACKAGE.parent)): megatron_flag_literals(p.read_text())
               for p in PACKAGE.rglob("*.py") if p != PACKAGE / "megatron" / "flags.py"}
    assert {path: flags for path, flags in spelled.items() if flags} == {}


def test_the_flag_check_sees_a_spelled_flag():
    assert megatron_flag_literals('args += ["--num-layers", 2]\nraise ValueError("--num-layers: bad")') == [
        "--num-layers"]
