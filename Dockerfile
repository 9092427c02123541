# One image for the manager, the agents and the demo job (CPU torch; the NVML backend needs the
# host's driver mounted in, the fake backend needs nothing).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# torch pinned first, from the CPU wheel index: nothing later may pull a CUDA build
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md alembic.ini ./
COPY ntp_manager ntp_manager
COPY migrations migrations
COPY agent agent
COPY proto proto
COPY examples examples
COPY deploy deploy
# This checkout's two distributions (nonuniform-tp-manager and the node agent's nonuniform-tp-agent),
# installed from the copied sources, never by name from the index (where `ntp-manager` is another
# project). A node image that runs only the agent would install `./agent .` alone: no torch, FastAPI
# or SQLAlchemy (docs/install.md).
RUN pip install ".[manager,worker]" ./agent
EXPOSE 8080 50051
