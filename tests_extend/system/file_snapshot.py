"""What 'nothing was changed' means for a checkpoint directory in the system tests."""
import hashlib
import os


def snapshot(root):
    """Every file under root with its bytes' hash and mtime."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out
