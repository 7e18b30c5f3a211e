"""No function in mindspeed/ over 60 lines (a reader holds one on a screen; a longer one is split into
named steps), and the flags are read where they are defined: at most 20 reads of a parsed flag with a
default of their own (`getattr(args, "flag", default)`), each for a flag some namespaces truly lack."""
import ast

from tests_extend.unit.source_trees import package_trees

NAMESPACES = ("args", "a", "ns", "namespace")


def test_no_function_over_60_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in package_trees() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert long == []


def test_flag_defaults_are_not_repeated_at_their_reads():
    reads = [f"{path}:{node.lineno}" for path, tree in package_trees() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
             and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id in NAMESPACES
             and isinstance(node.args[1], ast.Constant)]
    assert len(reads) <= 20, reads
