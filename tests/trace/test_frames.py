"""Source locations the diagnosis points at, read when the report is built (at exit)."""

import importlib.util
import sys

from gpudoctor.trace.frames import attribute_assignment_line

SOURCE = '''
class Head:
    def __init__(self):
        self.scale = 2.0

        self.prior = [0.5]  # <- line 6


class Other:
    pass
'''


def test_attribute_line_found_after_python_dropped_the_scripts_file(tmp_path):
    # `python script.py` deletes __main__.__file__ once the script returns, before atexit builds the report
    path = tmp_path / "user_script.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("gd_user_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gd_user_script"] = module
    try:
        spec.loader.exec_module(module)
        del module.__file__
        location = attribute_assignment_line(module.Head, "prior")
        assert location is not None and location["line"] == 6 and location["file"] == str(path)
        assert attribute_assignment_line(module.Other, "prior") is None  # no method: nothing says where it is
    finally:
        del sys.modules["gd_user_script"]
