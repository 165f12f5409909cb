# The scorestack image: the compiler, the feature jobs and the clients, with `scorestack` as the
# entry point (`docker run scorestack:0.1.0 compile --help`). It also holds the server environment
# (`scorestack server-env`: numpy<2 and the tritonserver of nvidia-pytriton 0.7.0), because the
# compiler verifies and measures every candidate in the environment that serves it and loads the
# selected model in a local Triton before it joins the repository.
#
# Build from the repository root:  docker build -t scorestack:0.1.0 .
# Python 3.11 on Debian 12 (glibc 2.36): the platform the project is built and tested on.
FROM python:3.11.7-slim-bookworm

# gcc and libc6-dev: TL2cgen compiles tree models to shared libraries with the machine's C compiler.
# libgomp1: OpenMP for XGBoost, ONNX Runtime and the TL2cgen libraries. curl: health checks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 curl \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    SCORESTACK_HOME=/opt/scorestack \
    SCORESTACK_SERVER_ENV=/opt/scorestack/server-env

WORKDIR /opt/scorestack/src
# torch is pinned in pyproject.toml (2.13.0); take its CPU build, never the multi-GB CUDA one that
# the default index serves for Linux.
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY scorestack/ scorestack/
COPY compile/ compile/
COPY serve/ serve/
COPY features/ features/
COPY client/ client/
COPY demo/ demo/
COPY cli/ cli/
RUN python -m pip install . \
    && scorestack server-env --path "$SCORESTACK_SERVER_ENV" \
    && rm -rf /opt/scorestack/src

# A non-root user; /work (models, specs, feature repository) is writable by it. The compose file
# may run the compile job as the host user instead (bind-mounted folders), so HOME is open to any.
RUN useradd --uid 10001 --create-home --home-dir /home/scorestack --shell /usr/sbin/nologin scorestack \
    && chmod 1777 /home/scorestack \
    && mkdir -p /work /features \
    && chown scorestack:scorestack /work /features
ENV HOME=/home/scorestack
USER scorestack
WORKDIR /work
ENTRYPOINT ["scorestack"]
CMD ["--help"]
