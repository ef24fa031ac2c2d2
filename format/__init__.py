"""lum.format: what the builder writes and the loader reads — symbolic expressions, dtypes, the package schema."""

from lum.format.expr import Expr, Var, Const, as_expr, cdiv, smin, smax, parse
from lum.format.dtypes import DType
from lum.format.shapetracker import ShapeTracker

__all__ = ["DType", "ShapeTracker", "Expr", "Var", "Const", "as_expr", "cdiv", "smin", "smax", "parse", "__version__"]

__version__ = "0.1.0"
