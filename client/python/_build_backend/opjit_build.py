"""PEP 517 build backend for the opjit Python client, standard library only.

pip (or `python -m build`) loads it through pyproject.toml's backend-path, so
building needs nothing from PyPI: an offline machine builds the wheel.

    build_wheel   opjit-<v>-py3-none-any.whl: opjit/*.py from this directory and
                  opjit/v1/*_pb2.py, *_pb2_grpc.py generated from the protos; where
                  a C++ compiler and Python's headers are found, also
                  opjit/_fastcall*.so (the compiled fast-channel call), and the
                  wheel is then opjit-<v>-cpXY-cpXY-<platform>.whl
    build_sdist   opjit-<v>.tar.gz: the sources, the protos (proto/) and PKG-INFO
    (build_editable is not offered: the stubs are generated; use the build
    tree's build/python with PYTHONPATH, or a regular install.)

Protos: ./proto (in an sdist), else ../../proto (in the repository).
Version: PKG-INFO (in an sdist), else the top-level CMakeLists.txt's
project(opjit VERSION x.y.z).
Extension: opjit/_fastcall.cc with proto/opjit/wire/fast_channel.h, built by
$CXX (else c++, g++ or clang++) for the running interpreter. It is optional:
without a compiler, with a failed compile or with OPJIT_PURE_PYTHON=1 (or
config setting pure=1) the wheel is pure Python, and opjit falls back to its
pure-Python channel.
Stubs: `protoc` with `grpc_python_plugin` (Debian's protobuf-compiler and
protobuf-compiler-grpc; the same generator the CMake build uses), else
`<python> -m grpc_tools.protoc` (pip's grpcio-tools) for this interpreter or
/usr/bin/python3. Debian 12's python3-grpc-tools bundles protoc 3.5, too old
for proto3 `optional`, so it is tried last. $PROTOC and $GRPC_PYTHON_PLUGIN
name the programs explicitly.
"""

import base64
import csv
import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # client/python
NAME = "opjit"
_WHEEL_TAG = "py3-none-any"


# ---- Metadata -----------------------------------------------------------------

def _pyproject():
    path = os.path.join(HERE, "pyproject.toml")
    with open(path, "rb") as f:
        data = f.read()
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            tomllib = None
    if tomllib is not None:
        return tomllib.loads(data.decode())["project"]
    # Older Pythons without tomli: the few plain keys this file uses.
    text = data.decode()
    project = {}
    section = text.split("[project]", 1)[1].split("\n[", 1)[0]
    for key in ("name", "description", "readme", "requires-python"):
        m = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(key), section, re.M)
        if m:
            project[key] = m.group(1)
    m = re.search(r"^dependencies\s*=\s*\[([^\]]*)\]", section, re.M)
    project["dependencies"] = re.findall(r'"([^"]+)"', m.group(1)) if m else []
    if "[project.optional-dependencies]" in text:
        extras = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        project["optional-dependencies"] = {
            k: re.findall(r'"([^"]+)"', v)
            for k, v in re.findall(r"^([A-Za-z0-9_.-]+)\s*=\s*\[([^\]]*)\]", extras, re.M)}
    return project


def _version():
    # An sdist's PKG-INFO first: an unpacked sdist's ../.. is not the repository.
    pkg_info = os.path.join(HERE, "PKG-INFO")
    if os.path.exists(pkg_info):
        with open(pkg_info) as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    cmake = os.path.join(HERE, "..", "..", "CMakeLists.txt")
    if os.path.exists(cmake):
        with open(cmake) as f:
            m = re.search(r"project\(\s*opjit\s+VERSION\s+([0-9][0-9A-Za-z.]*)", f.read())
        if m:
            return m.group(1)
    raise RuntimeError("opjit_build: no version (neither PKG-INFO nor ../../CMakeLists.txt)")


def _metadata():
    p = _pyproject()
    lines = [
        "Metadata-Version: 2.1",
        "Name: %s" % p.get("name", NAME),
        "Version: %s" % _version(),
        "Summary: %s" % p.get("description", ""),
    ]
    if p.get("requires-python"):
        lines.append("Requires-Python: %s" % p["requires-python"])
    for dep in p.get("dependencies", []):
        lines.append("Requires-Dist: %s" % dep)
    for extra, deps in sorted(p.get("optional-dependencies", {}).items()):
        lines.append("Provides-Extra: %s" % extra)
        for dep in deps:
            lines.append('Requires-Dist: %s; extra == "%s"' % (dep, extra))
    body = ""
    readme = p.get("readme")
    if isinstance(readme, str) and os.path.exists(os.path.join(HERE, readme)):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(HERE, readme), encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _dist_name():
    return "%s-%s" % (NAME, _version())


# ---- Stubs ----------------------------------------------------------------------

def _proto_root():
    for root in (os.path.join(HERE, "proto"), os.path.join(HERE, "..", "..", "proto")):
        if os.path.isdir(os.path.join(root, "opjit", "v1")):
            return os.path.normpath(root)
    raise RuntimeError("opjit_build: proto/opjit/v1 not found (neither ../../proto nor ./proto)")


def _protos(root):
    d = os.path.join(root, "opjit", "v1")
    return sorted("opjit/v1/" + f for f in os.listdir(d) if f.endswith(".proto"))


def _generators():
    """Commands that run protoc with a gRPC Python plugin, best first."""
    protoc = os.environ.get("PROTOC") or shutil.which("protoc")
    plugin = os.environ.get("GRPC_PYTHON_PLUGIN") or shutil.which("grpc_python_plugin")
    if protoc and plugin:
        yield [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        if python and os.path.exists(python):
            yield [python, "-m", "grpc_tools.protoc"]


def _generate_stubs(out_dir):
    """Writes opjit/v1/*_pb2.py and *_pb2_grpc.py under out_dir."""
    root = _proto_root()
    protos = _protos(root)
    errors = []
    for gen in _generators():
        shutil.rmtree(os.path.join(out_dir, "opjit"), ignore_errors=True)
        os.makedirs(out_dir, exist_ok=True)
        cmd = gen + ["--proto_path=" + root, "--python_out=" + out_dir,
                     "--grpc_python_out=" + out_dir] + protos
        try:
            r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        except OSError as e:
            errors.append("%s: %s" % (gen[0], e))
            continue
        if r.returncode == 0:
            return
        errors.append("%s: %s" % (" ".join(gen), (r.stderr or r.stdout).strip()[-400:]))
    raise RuntimeError(
        "opjit_build: cannot generate the opjit.v1 stubs. Install protoc and "
        "grpc_python_plugin (Debian: protobuf-compiler protobuf-compiler-grpc) or a "
        "grpcio-tools that supports proto3 optional.\n  " + "\n  ".join(errors))


# ---- Extension ---------------------------------------------------------------------

def _wire_root():
    """The directory holding proto/opjit/wire/fast_channel.h: this one (an
    sdist) or the repository's root."""
    for root in (HERE, os.path.join(HERE, "..", "..")):
        if os.path.isfile(os.path.join(root, "proto", "opjit", "wire", "fast_channel.h")):
            return os.path.normpath(root)
    return None


def _build_extension(out_dir, config_settings):
    """Compiles opjit/_fastcall.cc into out_dir: its file name, or None when
    it is not wanted or cannot be built here (the wheel is then pure Python)."""
    pure = (config_settings or {}).get("pure") or os.environ.get("OPJIT_PURE_PYTHON")
    src = os.path.join(HERE, NAME, "_fastcall.cc")
    root = _wire_root()
    include = sysconfig.get_paths().get("include") or ""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    cxx = os.environ.get("CXX") or next(
        (c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if pure not in (None, "", "0") or not os.path.isfile(src) or root is None or not cxx or \
            not suffix or not os.path.isfile(os.path.join(include, "Python.h")):
        return None
    name = "_fastcall" + suffix
    cmd = [cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
           "-I" + include, "-I" + root, src, "-o", os.path.join(out_dir, name)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        why = None if r.returncode == 0 else (r.stderr or r.stdout).strip()[-400:]
    except OSError as e:
        why = str(e)
    if why is not None:
        print("opjit_build: opjit._fastcall not built (the wheel is pure Python): %s" % why,
              file=sys.stderr)
        return None
    return name


def _platform_tag():
    v = "cp%d%d" % sys.version_info[:2]
    return "%s-%s-%s" % (v, v, re.sub(r"[-.]", "_", sysconfig.get_platform()))


# ---- Wheel -------------------------------------------------------------------------

def _package_files():
    """(archive name, file path) for every module of the package."""
    src = os.path.join(HERE, NAME)
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, HERE).replace(os.sep, "/"), path


def _record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _zip_info(name):
    # A fixed timestamp (or SOURCE_DATE_EPOCH): the same sources give the same wheel.
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    info = zipfile.ZipInfo(name, date_time=time.gmtime(max(epoch, 315532800))[:6])
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist_info = "%s.dist-info" % _dist_name()
    files = {}
    for arcname, path in _package_files():
        with open(path, "rb") as f:
            files[arcname] = f.read()
    with tempfile.TemporaryDirectory(prefix="opjit-stubs-") as tmp:
        _generate_stubs(tmp)
        gen_dir = os.path.join(tmp, "opjit", "v1")
        for f in sorted(os.listdir(gen_dir)):
            if f.endswith(".py"):
                with open(os.path.join(gen_dir, f), "rb") as fh:
                    files["opjit/v1/" + f] = fh.read()
        ext = _build_extension(tmp, config_settings)
        if ext is not None:
            with open(os.path.join(tmp, ext), "rb") as fh:
                files["opjit/" + ext] = fh.read()
    tag = _WHEEL_TAG if ext is None else _platform_tag()
    wheel_name = "%s-%s.whl" % (_dist_name(), tag)
    files[dist_info + "/METADATA"] = _metadata().encode()
    files[dist_info + "/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: opjit_build\n"
                                   "Root-Is-Purelib: %s\nTag: %s\n"
                                   % ("true" if ext is None else "false", tag)).encode()
    files[dist_info + "/top_level.txt"] = b"opjit\n"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        writer.writerow([name, _record_hash(data), len(data)])
    writer.writerow([dist_info + "/RECORD", "", ""])
    files[dist_info + "/RECORD"] = record.getvalue().encode()
    os.makedirs(wheel_directory, exist_ok=True)
    target = os.path.join(wheel_directory, wheel_name)
    with zipfile.ZipFile(target, "w") as z:
        for name, data in files.items():
            z.writestr(_zip_info(name), data)
    return wheel_name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    dist_info = "%s.dist-info" % _dist_name()
    d = os.path.join(metadata_directory, dist_info)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w", encoding="utf-8") as f:
        f.write(_metadata())
    return dist_info


def get_requires_for_build_wheel(config_settings=None):
    return []


# ---- sdist -------------------------------------------------------------------------

def build_sdist(sdist_directory, config_settings=None):
    base = _dist_name()
    members = [("pyproject.toml", os.path.join(HERE, "pyproject.toml"))]
    for extra in ("README.md",):
        if os.path.exists(os.path.join(HERE, extra)):
            members.append((extra, os.path.join(HERE, extra)))
    members.append(("_build_backend/opjit_build.py", os.path.abspath(__file__)))
    members.extend(_package_files())
    examples = os.path.join(HERE, "examples")
    if os.path.isdir(examples):
        for f in sorted(os.listdir(examples)):
            if f.endswith(".py"):
                members.append(("examples/" + f, os.path.join(examples, f)))
    root = _proto_root()
    for rel in _protos(root):
        members.append(("proto/" + rel, os.path.join(root, rel)))
    members.append((NAME + "/_fastcall.cc", os.path.join(HERE, NAME, "_fastcall.cc")))
    wire = _wire_root()
    if wire is not None:
        members.append(("proto/opjit/wire/fast_channel.h",
                        os.path.join(wire, "proto", "opjit", "wire", "fast_channel.h")))

    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    os.makedirs(sdist_directory, exist_ok=True)
    name = base + ".tar.gz"
    with open(os.path.join(sdist_directory, name), "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=epoch, filename="") as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                def add(arcname, data):
                    info = tarfile.TarInfo(base + "/" + arcname)
                    info.size = len(data)
                    info.mtime = epoch
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(data))
                add("PKG-INFO", _metadata().encode())
                for arcname, path in members:
                    with open(path, "rb") as f:
                        add(arcname, f.read())
    return name


def get_requires_for_build_sdist(config_settings=None):
    return []
