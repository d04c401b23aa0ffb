"""IPython start-up code of Corral's code-interpreter kernels: the extra
display formats E2B's clients read.

  e2b/data          a pandas DataFrame as {column: [values]} (Result.data)
  e2b/chart         a matplotlib Figure as E2B's chart dict (Result.chart),
                    through the e2b_charts package
  application/json  lists and dicts as JSON (numpy values included)

and a PIL image saved to a file is displayed too (a PNG in the results),
since there is no screen to show it on.

Each formatter looks for its library in sys.modules first: displaying `1 + 1`
must not import pandas or matplotlib.
"""

import sys

from IPython import get_ipython
from IPython.core.formatters import BaseFormatter, JSONFormatter
from traitlets import ObjectName, Unicode


class _DataFrames(BaseFormatter):
    format_type = Unicode("e2b/data")
    print_method = ObjectName("_repr_e2b_data_")
    _return_type = (dict, str)

    def __call__(self, obj):
        pandas = sys.modules.get("pandas")
        if pandas is None or not isinstance(obj, pandas.DataFrame):
            return super().__call__(obj)
        columns = obj.to_dict(orient="list")
        return {
            name: [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
            for name, values in columns.items()
        }


class _Charts(BaseFormatter):
    format_type = Unicode("e2b/chart")
    print_method = ObjectName("_repr_e2b_chart_")
    _return_type = (dict, str)

    def __call__(self, obj):
        if "matplotlib" not in sys.modules:
            return super().__call__(obj)
        from matplotlib.figure import Figure

        if not isinstance(obj, Figure):
            return super().__call__(obj)
        try:
            from e2b_charts import chart_figure_to_dict

            return chart_figure_to_dict(obj)
        except Exception:  # a figure the extractor does not understand: no chart
            return {}


class _Json(JSONFormatter):
    def __call__(self, obj):
        if isinstance(obj, list | dict):
            try:
                import orjson

                flags = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
                return orjson.loads(orjson.dumps(obj, option=flags)), {"expanded": True}
            except TypeError:
                pass
        return super().__call__(obj)


def _show_saved_images() -> None:
    try:
        from IPython.display import display
        from PIL import Image
    except ImportError:
        return
    save = Image.Image.save

    def save_and_show(self, fp, format=None, **params):
        if isinstance(fp, str):
            display(self)
        return save(self, fp, format, **params)

    Image.Image.save = save_and_show


_show_saved_images()
_shell = get_ipython()
_fmt = _shell.display_formatter
_fmt.formatters["e2b/data"] = _DataFrames(parent=_fmt)
_fmt.formatters["e2b/chart"] = _Charts(parent=_fmt)
_fmt.formatters["application/json"] = _Json(parent=_fmt)
del _shell, _fmt
