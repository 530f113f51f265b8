"""IPython support: ``%load_ext gpudoctor`` then ``%%gpudoctor [--deep]`` on a cell."""

from __future__ import annotations


def load_ipython_extension(ipython) -> None:
    def gpudoctor(line: str, cell: str):
        from gpudoctor.trace.api import Probe

        probe = Probe(deep="--deep" in line.split(), print_on_error=False).install()
        result = None
        try:
            result = ipython.run_cell(cell)
        finally:
            error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            try:
                probe.last_exception = error
                probe.print_report(exc=error)
            finally:
                probe.uninstall()
        return None

    ipython.register_magic_function(gpudoctor, magic_kind="cell", magic_name="gpudoctor")


def unload_ipython_extension(ipython) -> None:  # nothing global stays installed between cells
    return None
