# One image for every Kiln process (API, control worker, gpu worker, example environments).
# CPU torch by default (image kiln:cpu). The CUDA variant for gpu workers (kiln:cuda) is the same
# file built with a CUDA wheel index — the torch wheels bring the CUDA runtime; the host needs only
# the NVIDIA driver and the container toolkit:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t kiln:cuda .
FROM python:3.11.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY kiln ./kiln
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY api ./api
COPY examples ./examples
# Every package at the exact version Kiln was tested with (constraints.txt), torch included.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
 && pip install --no-cache-dir -c constraints.txt ".[train,envs]" \
 && pip install --no-cache-dir --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2" \
 && useradd --create-home --uid 10001 kiln && mkdir -p /data && chown kiln /data
ENV HF_HUB_OFFLINE=1 KILN_HOME=/data PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER kiln
VOLUME /data
CMD ["kiln", "--help"]
