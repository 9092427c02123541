# One image for the manager, the agents and the demo job (CPU torch; the NVML backend needs the
# host's driver mounted in, the fake backend needs nothing).
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# torch pinned first, from the CPU wheel index: nothing later may pull a CUDA build
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY ntp_manager ntp_manager
COPY proto proto
COPY examples examples
COPY deploy deploy
RUN pip install ".[manager,agent,worker]"
EXPOSE 8080 50051
