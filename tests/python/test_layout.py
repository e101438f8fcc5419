"""The Python package's import layering: ragshard.torch (the module, its hooks and optimizers)
does not import ragshard.checkpoint, which builds on it, at any depth: no module of
ragshard/torch names it in an import, top-level or inside a function."""
import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "python", "ragshard")


def imported_modules(path):
    """(module, level) of every import in the file, anywhere in it."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def test_the_torch_package_does_not_import_checkpoint():
    folder = os.path.join(ROOT, "torch")
    offenders = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        for module, level in imported_modules(os.path.join(folder, name)):
            parts = module.split(".")
            # ..checkpoint (level 2), ragshard.checkpoint, or a relative path through it
            if "checkpoint" in parts and (level == 2 or parts[0] == "ragshard"):
                offenders.append(f"torch/{name}: {'.' * level}{module}")
    assert offenders == [], offenders


def test_the_check_finds_such_an_import(tmp_path):
    # The walk sees imports inside functions (where the old cycle was).
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from ..checkpoint import _state\n")
    assert ("checkpoint", 2) in list(imported_modules(str(f)))
