"""mindspore backend. capabilities.py, msadapter.py, device_select.py and worker_exit.py import no
framework at module level; the other submodules import mindspore."""
