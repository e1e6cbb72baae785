"""Physical quantities in answers: ``3.2 m/s`` split into a number and a unit, and units compared by dimension.

What is supported (anything else is "not a unit", and :mod:`trl_sae.rewards.science` then refuses to convert):

* **Numbers**: decimals (``3.2``, ``-.5``, ``1,000``, ``1{,}000``), scientific notation (``6.6e-34``,
  ``6.6 \\times 10^{-34}``, ``6.6×10^-34``, ``6.6 \\cdot 10^{-34}``, ``10^{5}``).
* **Unit symbols**: the SI base and derived units ``m g s A K mol cd N J W Pa Hz C V Ω (ohm) F T Wb H S eV
  L (l) M (mol/L) bar Bq Gy Sv Da u rad sr cal`` with the SI prefixes ``Y Z E P T G M k h da d c m µ (μ, u)
  n p f a z y`` (``km``, ``MeV``, ``µmol``, ``mM``); ``min h hr d day yr year atm Torr mmHg Å (angstrom)
  ° (deg) %`` without prefixes; and a few spelled-out names (``meters``, ``seconds``, ``joules``,
  ``kelvin`` ...). ``°C`` and ``°F`` are affine scales: they are kept as their own units, equal only to
  themselves (a temperature and a temperature difference would convert differently).
* **Unit expressions**: products by space, ``*``, ``·`` or ``\\cdot``; quotients by ``/``; powers ``^2``,
  ``^{-1}``, ``^(-1)``, ``**2``, ``²``, ``⁻¹``; parentheses. Juxtaposition binds tighter than ``/``:
  ``J/mol K`` is ``J/(mol K)`` (the usual reading), while ``J/mol*K`` is ``(J/mol) K``.
* **LaTeX**: ``$``, ``\\boxed{}``, ``\\text{}``, ``\\mathrm{}``, ``\\rm``, ``\\,``, ``\\ ``, ``~``, ``^\\circ``, ``\\mu``,
  ``\\Omega``, ``\\%`` and ``\\frac{a}{b}`` are read as the plain forms above.

Conversion factors come from :mod:`sympy.physics.units` (imported on first use). Nothing here evaluates
text as code: unit strings are read by a small grammar over the symbols above.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Quantity",
    "Unit",
    "conversion_factor",
    "parse_number",
    "parse_unit",
    "plain",
    "same_unit_text",
    "split_quantity",
]

# --------------------------------------------------------------------------------------------------
# LaTeX and typography to plain text.
# --------------------------------------------------------------------------------------------------
_UNWRAP_RE = re.compile(r"\\(?:text|textrm|mathrm|mathit|mathbf|operatorname|rm|mbox|boxed)\s*\{")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_REPLACEMENTS = (
    (r"\left", ""),
    (r"\right", ""),
    (r"\!", ""),
    (r"\,", " "),
    (r"\;", " "),
    (r"\:", " "),
    (r"\quad", " "),
    (r"\ ", " "),
    ("~", " "),
    (r"\%", "%"),
    (r"\mu", "µ"),
    (r"\Omega", "Ω"),
    (r"\AA", "Å"),
    (r"\cdot", "·"),
    (r"\times", "×"),
    (r"\degree", "°"),
    ("^{\\circ}", "°"),
    ("^\\circ", "°"),
    ("\\circ", "°"),
    ("℃", "°C"),
    ("℉", "°F"),
    ("−", "-"),  # the typographic minus sign
    ("μ", "µ"),  # Greek mu and the micro sign are one prefix
    ("⋅", "·"),
    ("$", ""),
)


def _unwrap(text: str) -> str:
    """``\\mathrm{J\\,mol^{-1}}`` -> `` J\\,mol^{-1} `` (balanced braces), for each text wrapper."""
    while (match := _UNWRAP_RE.search(text)) is not None:
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:  # never closed: drop the command, keep the rest
            return text[: match.start()] + text[match.end() :]
        text = f"{text[: match.start()]} {text[match.end() : i - 1]} {text[i:]}"
    return text


def plain(text: str) -> str:
    """``text`` with the LaTeX and typography of answers replaced by plain forms (see the module doc)."""
    text = str(text)
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    text = _unwrap(text)
    previous = None
    while previous != text:  # nested: \frac{\frac{1}{2}}{s}
        previous, text = text, _FRAC_RE.sub(r"(\1)/(\2)", text)
    text = re.sub(r"°\s*([CF])(?![A-Za-z])", r"°\1", text)  # "25 ° C" is 25 °C, not degree-coulombs
    return " ".join(text.split())


# --------------------------------------------------------------------------------------------------
# Numbers.
# --------------------------------------------------------------------------------------------------
_MANTISSA = r"[-+]?(?:\d{1,3}(?:(?:,|\{,\})\d{3})+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)"
_EXPONENT = r"(?:\s*[eE][-+]?\d+|\s*[×x*·]\s*10\s*\^\s*(?:\{\s*[-+]?\d+\s*\}|\(\s*[-+]?\d+\s*\)|[-+]?\d+))"
_POWER_OF_TEN = r"[-+]?10\s*\^\s*(?:\{\s*[-+]?\d+\s*\}|\(\s*[-+]?\d+\s*\)|[-+]?\d+)"
_NUMBER_RE = re.compile(rf"(?:{_MANTISSA}{_EXPONENT}?|{_POWER_OF_TEN})")


def parse_number(text: str) -> float | None:
    """The value of a plain number (decimal or scientific notation, see the module doc), else ``None``.

    Example:
        >>> parse_number(r"6.6 \\times 10^{-34}"), parse_number("1,000"), parse_number(r"\\frac{1}{2}")
        (6.6e-34, 1000.0, None)
    """
    text = plain(text).strip()
    if not _NUMBER_RE.fullmatch(text):
        return None
    text = text.replace("{,}", "").replace(",", "")
    power = re.fullmatch(r"([-+]?)10\s*\^\s*[{(]?\s*([-+]?\d+)\s*[})]?", text)
    if power is not None:
        mantissa, exponent = f"{power.group(1)}1", power.group(2)
    else:
        parts = re.split(r"\s*(?:[eE]|[×x*·]\s*10\s*\^)\s*", text, maxsplit=1)
        mantissa, exponent = parts[0], (parts[1].strip("{}() ") if len(parts) > 1 else "0")
    try:
        value = float(f"{mantissa}e{int(exponent)}")
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------------------------------
# Units.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """A unit as ``factor`` x a product of SI base units (``dimension``: base unit -> power), or an affine
    temperature scale (``affine``: its name; such a unit equals only itself)."""

    factor: float
    dimension: tuple[tuple[str, float], ...]
    affine: str | None = None


_PREFIXES = {
    "Y": 1e24, "Z": 1e21, "E": 1e18, "P": 1e15, "T": 1e12, "G": 1e9, "M": 1e6, "k": 1e3, "h": 1e2,
    "da": 1e1, "d": 1e-1, "c": 1e-2, "m": 1e-3, "µ": 1e-6, "u": 1e-6, "n": 1e-9, "p": 1e-12,
    "f": 1e-15, "a": 1e-18, "z": 1e-21, "y": 1e-24,
}  # fmt: skip

_DEGREE = ((("radian", 1),), math.pi / 180)  # an angle, convertible to rad
_PERCENT = ((), 0.01)  # a pure number

# symbol -> the sympy.physics.units expression it stands for (a name, or a product written as a tuple of
# (name, power) pairs and a number). Prefixable symbols take the SI prefixes.
_PREFIXABLE: dict[str, Any] = {
    "m": "meter", "g": "gram", "s": "second", "A": "ampere", "K": "kelvin", "mol": "mole",
    "cd": "candela", "N": "newton", "J": "joule", "W": "watt", "Pa": "pascal", "Hz": "hertz",
    "C": "coulomb", "V": "volt", "Ω": "ohm", "ohm": "ohm", "F": "farad", "T": "tesla", "Wb": "weber",
    "H": "henry", "S": "siemens", "eV": "electronvolt", "L": "liter", "l": "liter",
    "M": ((("mole", 1), ("liter", -1)), 1.0), "bar": "bar", "Bq": "becquerel", "Gy": "gray",
    "Sv": "gray", "Da": "dalton", "u": "amu", "rad": "radian", "sr": "steradian",
    "cal": ((("joule", 1),), 4.184),
}  # fmt: skip
_PLAIN: dict[str, Any] = {
    "min": "minute", "h": "hour", "hr": "hour", "d": "day", "day": "day", "days": "day", "yr": "year",
    "year": "year", "years": "year", "atm": "atmosphere", "Torr": "torr", "torr": "torr", "mmHg": "mmHg",
    "Å": "angstrom", "angstrom": "angstrom", "°": _DEGREE, "deg": _DEGREE, "degree": _DEGREE,
    "degrees": _DEGREE, "%": _PERCENT, "percent": _PERCENT, "amu": "amu",
}  # fmt: skip
_NAMES = {
    "meter": "meter", "metre": "meter", "second": "second", "gram": "gram", "kilogram": "kilogram",
    "joule": "joule", "newton": "newton", "watt": "watt", "pascal": "pascal", "hertz": "hertz",
    "kelvin": "kelvin", "mole": "mole", "volt": "volt", "ampere": "ampere", "amp": "ampere",
    "coulomb": "coulomb", "liter": "liter", "litre": "liter", "hour": "hour", "minute": "minute",
    "electronvolt": "electronvolt",
}  # fmt: skip
for _name, _unit in list(_NAMES.items()):
    _PLAIN[_name] = _PLAIN[_name + "s"] = _unit
_PLAIN["ohms"] = "ohm"
_AFFINE = {"°C": "°C", "degC": "°C", "°F": "°F", "degF": "°F"}

_BASE = ("kilogram", "meter", "second", "ampere", "kelvin", "mole", "candela")


@functools.cache
def _si(name: str) -> Unit:
    """A sympy.physics.units quantity as ``factor`` x SI base units."""
    from sympy import Number
    from sympy.physics import units
    from sympy.physics.units import convert_to

    converted = convert_to(getattr(units, name), [getattr(units, b) for b in _BASE])
    factor, powers = 1.0, {}
    for base, power in converted.as_powers_dict().items():
        if isinstance(base, Number) or base.is_number:
            factor *= float(base) ** float(power)
        else:
            powers[str(base)] = float(power)
    return Unit(factor, tuple(sorted(powers.items())))


def _compose(spec: Any) -> Unit:
    if isinstance(spec, str):
        return _si(spec)
    parts, factor = spec
    unit = Unit(factor, ())
    for name, power in parts:
        unit = _multiply(unit, _si(name), power)
    return unit


def _multiply(left: Unit, right: Unit, power: float = 1.0) -> Unit:
    dims: dict[str, float] = dict(left.dimension)
    for base, p in right.dimension:
        dims[base] = dims.get(base, 0.0) + p * power
    return Unit(
        left.factor * right.factor**power, tuple(sorted((b, p) for b, p in dims.items() if abs(p) > 1e-12))
    )


def _symbol(token: str) -> Unit | None:
    """The unit a symbol stands for: an exact symbol, then a prefix plus a prefixable symbol."""
    if token in _PREFIXABLE:
        return _compose(_PREFIXABLE[token])
    if token in _PLAIN:
        return _compose(_PLAIN[token])
    for size in (2, 1):
        prefix, rest = token[:size], token[size:]
        if prefix in _PREFIXES and rest in _PREFIXABLE:
            return _multiply(Unit(_PREFIXES[prefix], ()), _compose(_PREFIXABLE[rest]))
    if token.lower() in _PLAIN:  # "Meters", "Joules"
        return _compose(_PLAIN[token.lower()])
    return None


_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")
_TOKEN_RE = re.compile(r"\s*(°[CF]|deg[CF]|[A-Za-zµΩÅ°%]+|\d+|\*\*|[*/^()·×{}+-])")
_MAX_TOKENS = 40
_MAX_POWER = 12


class _UnitParser:
    """expr := group (('*' | '/') group)*;  group := power+ (juxtaposition);  power := atom ['^' exponent];
    atom := SYMBOL | '(' expr ')'."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def expr(self) -> Unit:
        unit = self.group()
        while self.peek() in ("*", "/", "·", "×"):
            op = self.take()
            unit = _multiply(unit, self.group(), -1.0 if op == "/" else 1.0)
        return unit

    def group(self) -> Unit:
        unit = self.power()
        while self.peek() is not None and self.peek() not in ("*", "/", "·", "×", ")", "}"):
            unit = _multiply(unit, self.power())
        return unit

    def power(self) -> Unit:
        unit = self.atom()
        if self.peek() in ("^", "**"):
            self.take()
            unit = _multiply(Unit(1.0, ()), unit, self.exponent())
        return unit

    def exponent(self) -> float:
        closing = {"(": ")", "{": "}"}.get(self.peek() or "")
        if closing:
            self.take()
        sign = -1.0 if self.peek() == "-" else 1.0
        if self.peek() in ("-", "+"):
            self.take()
        token = self.take()
        if not token.isdigit():
            raise ValueError(token)
        value = float(token)
        if closing and self.peek() == "/":
            self.take()
            denominator = self.take()
            if not denominator.isdigit() or int(denominator) == 0:
                raise ValueError(denominator)
            value /= float(denominator)
        if closing and self.take() != closing:
            raise ValueError("unbalanced")
        if value > _MAX_POWER:
            raise ValueError("power too large")
        return sign * value

    def atom(self) -> Unit:
        token = self.take()
        if token in ("(", "{"):
            unit = self.expr()
            if self.take() != {"(": ")", "{": "}"}[token]:
                raise ValueError("unbalanced")
            return unit
        unit = _symbol(token)
        if unit is None:
            raise ValueError(token)
        return unit


def parse_unit(text: str) -> Unit | None:
    """The unit ``text`` names (see the module doc), or ``None`` if it is not one.

    Example:
        >>> parse_unit("m s^-1") == parse_unit("m/s"), parse_unit("km/h").factor
        (True, 0.2777777777777778)
        >>> parse_unit("apples") is None
        True
    """
    text = plain(text).translate(_SUPERSCRIPTS).strip()
    if not text:
        return None
    if text in _AFFINE:
        return Unit(1.0, (), affine=_AFFINE[text])
    # "s⁻¹" became "s-1": a sign right after a symbol is an exponent.
    text = re.sub(r"(?<=[A-Za-zµΩÅ)])([-+]\d+)", r"^\1", text)
    text = re.sub(r"(?<=[A-Za-zµΩÅ)])(\d+)", r"^\1", text)  # m2 -> m^2
    tokens: list[str] = []
    position = 0
    while position < len(text):
        match = _TOKEN_RE.match(text, position)
        if match is None:
            return None
        tokens.append(match.group(1))
        position = match.end()
        if len(tokens) > _MAX_TOKENS:
            return None
    if not any(t[0].isalpha() or t[0] in "µΩÅ°%" for t in tokens):
        return None
    parser = _UnitParser(tokens)
    try:
        unit = parser.expr()
    except (ValueError, IndexError, OverflowError, ZeroDivisionError):
        return None
    if parser.i != len(tokens) or not math.isfinite(unit.factor) or unit.factor == 0:
        return None
    return unit


# --------------------------------------------------------------------------------------------------
# Quantities.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Quantity:
    """An answer split into its value and its unit.

    Attributes:
        expression: the value's text (plain text, see :func:`plain`), e.g. ``"3.2"`` or ``"(16)/(5)"``.
        number: its value when it is a plain number (:func:`parse_number`), else ``None`` (symbolic).
        unit_text: the unit's text (``""`` for none).
        unit: the parsed unit, ``None`` for none (or for a ``unit_text`` that is not one).
    """

    expression: str
    number: float | None
    unit_text: str
    unit: Unit | None


_OPERATOR_END = tuple("+-*/^=(·×,")
_MAX_UNIT_CHARS = 64


def split_quantity(text: str) -> Quantity:
    """``text`` as a value and a unit: a leading plain number and a unit after it (``3.2 m/s``, ``300K``),
    or any value followed, after a space, by a unit (``(16)/(5) m/s``); else the whole text without a unit.

    Example:
        >>> q = split_quantity(r"1.5 \\times 10^{3}\\ \\mathrm{J\\,mol^{-1}}")
        >>> q.number, q.unit_text
        (1500.0, 'J mol^{-1}')
    """
    text = plain(text).strip().rstrip(".")
    number = _NUMBER_RE.match(text)
    if number is not None and number.end() < len(text):
        rest = text[number.end() :].strip()
        unit = parse_unit(rest)
        if unit is not None:
            value = text[: number.end()].strip()
            return Quantity(value, parse_number(value), rest, unit)
    for space in (m.start() for m in re.finditer(r" ", text)):
        if len(text) - space > _MAX_UNIT_CHARS:
            continue  # units are short: a long tail is no unit (and reading it costs time)
        value, rest = text[:space].strip(), text[space + 1 :].strip()
        if not value or value.endswith(_OPERATOR_END) or rest.startswith(("=", "+", "-")):
            continue
        unit = parse_unit(rest)
        if unit is not None:
            return Quantity(value, parse_number(value), rest, unit)
    return Quantity(text, parse_number(text), "", None)


def same_unit_text(left: str, right: str) -> bool:
    """Whether two unit texts are written alike (spaces and ``{}`` aside)."""

    def key(text: str) -> str:
        return re.sub(r"[\s{}]", "", plain(text).translate(_SUPERSCRIPTS))

    return key(left) == key(right)


def conversion_factor(source: Unit, target: Unit) -> float | None:
    """The number a value in ``source`` is multiplied by to be in ``target``; ``None`` when they measure
    different dimensions (or an affine scale meets another unit)."""
    if source.affine or target.affine:
        return 1.0 if source.affine == target.affine else None
    if _dimension_map(source.dimension) != _dimension_map(target.dimension):
        return None
    return source.factor / target.factor


def _dimension_map(dimension: tuple[tuple[str, float], ...]) -> Mapping[str, float]:
    return {base: round(power, 9) for base, power in dimension}
