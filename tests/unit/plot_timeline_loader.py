"""tools/plot_timeline.py loaded by path (tools/ is not a package)."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "plot_timeline.py")
_spec = importlib.util.spec_from_file_location("plot_timeline", _PATH)
plot_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_timeline)
