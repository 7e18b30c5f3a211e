"""MindSpeed's own source files, parsed: what the tests of the code's shape read."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "mindspeed")


def package_trees():
    """(path relative to mindspeed/, its AST) for every module of the package."""
    for folder, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE), ast.parse(f.read(), path)
