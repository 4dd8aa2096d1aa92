"""The matplotlib backend of workers (``MPLBACKEND=module://monarch_nb.worker.mpl_backend``).

Agg renders; ``plt.show()`` inside a ``%%monarch`` cell hands the open figures
to the cell's output (as the inline backend of Jupyter does) instead of
warning that Agg cannot show anything. Figures still open when a cell ends are
sent too.
"""

from matplotlib.backend_bases import FigureManagerBase as FigureManager  # noqa: F401
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas  # noqa: F401


def show(*args, **kwargs) -> None:
    from .display import show_figures

    show_figures()
