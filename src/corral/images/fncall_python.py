"""The Python packages that code problems import, as a toolkit layer over
the function image (fncall:bookworm): what SandboxFusion's python runtime
gives its calls, less the GPU stacks and what needs a display (listed
below), which no judged snippet can use here.

Pinned; built once, found again by its label. `python -m
corral.images.fncall_python` builds it (the install script does).
"""

from __future__ import annotations

from pathlib import Path

from corral.images import pypi
from corral.images.build import build_cached
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

TAG = "fncall-python:bookworm"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
PACKAGES = [
    "requests==2.32.3",
    "numpy==1.26.4",
    "pandas==2.2.3",
    "scipy==1.11.4",  # gensim 4.3 needs scipy.linalg.triu, gone in 1.13
    "sympy==1.13.3",
    "networkx==3.3",
    "matplotlib==3.9.2",
    "scikit-learn==1.5.2",
    "pytest==8.3.3",
    "beautifulsoup4==4.12.3",
    "lxml==5.3.0",
    "pillow==10.4.0",
    "openpyxl==3.1.5",
    "sortedcontainers==2.4.0",
    "toml==0.10.2",
    "PyJWT==2.9.0",
    "Flask==3.0.3",
    "psutil==6.0.0",
    "ipykernel==6.29.5",
    "jupyter_client==8.6.3",
    "ipython==8.29.0",
    # The rest of SandboxFusion's python runtime (its
    # runtime/python/requirements.txt), at its pins where they have CPython
    # 3.11 wheels, for the CPU. Left out: torch, tensorflow, torchinfo and
    # torchsummary (GPU stacks of gigabytes), PyQt5 and pytest-qt (a Qt
    # display), kaleido (ships its own Chromium), yolk (Python 2 only),
    # nameko, Flask-GraphQL (pins graphql-core 2, against graphene 3),
    # pyzbar (needs libzbar), bs4 (an alias of beautifulsoup4), jupyter (a
    # meta-package: the kernel is above), and fastdtw, Flask-Testing and
    # pandasql (source distributions only: nothing here builds them for
    # the image's Python). opencv-python is its headless build (no libGL in
    # a worker). nltk's and textblob's corpora are downloads from GitHub,
    # which no build here reaches: both import, and what needs a corpus
    # says so.
    "pytest-mock==3.12.0",
    "Django==5.0.1",
    "WTForms==3.1.2",
    "Flask-Limiter==3.5.0",
    "coverage==7.4.0",
    "shapely==2.0.2",
    "xlrd==2.0.1",
    "numba==0.58.1",
    "absl-py==2.1.0",
    "opencv-python-headless==4.9.0.80",
    "plotly==5.18.0",
    "requests-toolbelt==1.0.0",
    "XlsxWriter==3.1.9",
    "Flask-RESTful==0.3.10",
    "scikit-image==0.22.0",
    "pycryptodomex==3.20.0",
    "pycryptodome==3.20.0",
    "statsmodels==0.14.1",
    "kneed==0.8.5",
    "GitPython==3.1.41",
    "Werkzeug==3.0.3",
    "gmpy2==2.1.5",
    "redis==5.0.1",
    # redis needs it below Python 3.11.3 (the image has 3.11.2); pip judges
    # that marker by the Python that runs the build.
    "async-timeout==4.0.3",
    "pika==1.3.2",
    "pymongo==4.6.1",
    "mongomock==4.1.2",
    "jsonlines==4.0.0",
    "faiss-cpu==1.7.4",
    "gql==3.5.0",
    "graphene==3.3",
    "graphql-core==3.2.3",
    "Flask-SQLAlchemy==3.1.1",
    "Flask-Caching==2.1.0",
    "Flask-WTF==1.2.1",
    "xgboost==2.0.3",
    "gensim==4.3.2",
    "datasketch==1.6.4",
    "uvloop==0.19.0",
    "antlr4-python3-runtime==4.13.1",
    "arch==6.3.0",
    "lightgbm==4.3.0",
    "catboost==1.2.3",
    "xarray==2023.6.0",
    "pmdarima==2.0.4",
    "ruptures==1.1.9",
    "cryptography==42.0.5",
    "nltk==3.8.1",
    "pulp==2.8.0",
    "cvxpy==1.4.3",
    "python-docx==1.1.2",
    "PyPDF2==3.0.1",
    "APScheduler==3.10.4",
    "colorama==0.4.4",
    "folium==0.16.0",
    "xlwt==1.3.0",
    "textblob==0.18.0.post0",
    "PyMuPDF==1.24.3",
    "Faker==25.1.0",
    "pytest-cov==5.0.0",
    "astor==0.8.1",
    "seaborn==0.13.2",
    "tabulate==0.9.0",
    "rdkit==2023.9.4",
    "tree-sitter==0.20.4",
    "tree-sitter-languages==1.9.1",
    "docker==7.0.0",
    "pyscf==2.4.0",
    "pyberny==0.6.3",
    "grpcio-tools==1.60.0",
    "pydantic==2.6.4",
]


def build(store: ImageStore, progress: ProgressFn) -> Layer:
    def fill(stage: Path) -> None:
        pypi.install(stage, PACKAGES, "the function calls' Python packages", progress)
        pypi.launcher(stage, "pytest", "pytest:console_main")
        # debootstrap's root has no /etc/hosts: without it "localhost" does
        # not resolve, and a call's own server on localhost is unreachable.
        (stage / "etc").mkdir()
        (stage / "etc/hosts").write_text(HOSTS)

    key = "pip:" + ",".join(PACKAGES) + ":hosts"
    return build_cached(store, TAG, key, fill, progress=progress)


if __name__ == "__main__":
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        built = build(ImageStore(cfg.images_dir), bar)
    print(f"{TAG} {built.digest} ({built.content_size / 2**20:.1f} MiB)")
