# One image for every Kiln process (API, control worker, gpu worker, example environments).
# CPU torch by default; for a CUDA gpu worker, build with --build-arg TORCH_INDEX=<your CUDA index>.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kiln ./kiln
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY api ./api
COPY examples ./examples
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
 && pip install --no-cache-dir ".[train,envs]" \
 && pip install --no-cache-dir --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
ENV HF_HUB_OFFLINE=1 KILN_HOME=/data
VOLUME /data
CMD ["kiln", "--help"]
