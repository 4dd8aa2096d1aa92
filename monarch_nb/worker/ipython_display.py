"""``display()`` on a worker: IPython's display machinery, published through the
worker's display path (``display.publish``), so that ``display(HTML(...))`` reaches
the notebook as its MIME bundle, with the cell's values and figures."""

from __future__ import annotations

from IPython.core.displaypub import DisplayPublisher

from . import display


class WorkerDisplayPublisher(DisplayPublisher):
    """Publishes to the running ``%%monarch`` cell; elsewhere (a thread of the cell,
    a remote function) prints the ``text/plain`` form as output."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
        display.publish(data, metadata, transient, update)

    def clear_output(self, wait=False):
        display.clear_output(wait)


def register_formatters(formatter) -> None:
    """``display(fig)`` of a matplotlib figure is its PNG, as the inline backend shows it."""
    formatter.formatters["image/png"].for_type_by_name(
        "matplotlib.figure", "Figure", display.figure_png
    )
