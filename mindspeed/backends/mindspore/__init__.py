"""mindspore backend. capabilities.py, msadapter.py and device_select.py import no framework at
module level; the other submodules import mindspore."""
