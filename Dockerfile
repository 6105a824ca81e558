# Baton: scheduler, executor and CLI in one image; ENTRYPOINT is the `baton` CLI, so
#   docker run --rm baton:latest scheduler --redis-url redis://... --port 50051
#   docker run --rm baton:latest executor --redis-url redis://... --model /models/tiny
# See docker-compose.yml for the full stack.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The torch wheel, installed first and on its own, exactly as CI does (`pip install torch==2.13.0`).
# On GPU hosts swap in a CUDA build, e.g.
#   docker build --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" .
# (or set the same build arg under `build.args` in docker-compose.yml).
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install ${TORCH_SPEC}

# A C compiler: on CPU the executor builds its native decode-attention kernel on first start
# (about a second; executor_service/kernels). Without one it falls back to torch SDPA.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/baton

# Dependencies next, from pyproject.toml alone, so that editing the source does not
# re-download them: the layer is rebuilt only when pyproject.toml changes. torch is
# already satisfied by the layer above, so this does not replace it.
# constraints.txt pins the versions CI tests, so the image runs what CI ran.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The project itself, as CI installs it (`pip install .`); dependencies are already present.
COPY . .
RUN pip install -c constraints.txt . \
    && rm -rf build *.egg-info

# Run as an unprivileged user. /models and /secrets are created here, owned by that user, so a
# named volume mounted there starts out writable by it (docker copies the ownership of the
# image's directory into an empty named volume).
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin baton \
    && mkdir -p /models /secrets \
    && chown baton:baton /models /secrets
USER baton
WORKDIR /home/baton
ENV HF_HOME=/home/baton/.cache/huggingface

# Scheduler's public gRPC port and the executor's default port.
EXPOSE 50051 50061

ENTRYPOINT ["baton"]
CMD ["--help"]
