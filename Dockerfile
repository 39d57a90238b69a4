# One image for every testbed role (see docker-compose.yml and testbed/entrypoint.sh).
# Without network access in the build, run testbed/wheelhouse.sh first: the image then installs from
# testbed/wheelhouse with --no-index. BASE_IMAGE may be a local image from testbed/make-base-image.sh.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# WITH_TORCH=1 installs torch too (CPU build), for TASK=train (the training example across containers)
ARG WITH_TORCH=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1
COPY pyproject.toml README.md /src/
COPY host /src/host
COPY switch_p4 /src/switch_p4
COPY emulator /src/emulator
COPY testbed/wheelhouse /wheelhouse
# Every image has the switch extra (the emulated switch's P4Runtime control plane); WITH_TORCH adds torch.
RUN extras=switch; if [ "$WITH_TORCH" = 1 ]; then extras=switch,torch; fi \
 && python3 -m venv /opt/zerosum \
 && if ls /wheelhouse/zerosum-*.whl >/dev/null 2>&1; then \
        /opt/zerosum/bin/pip install --no-index --find-links /wheelhouse "zerosum[$extras]"; \
    else \
        /opt/zerosum/bin/pip install "/src[$extras]"; \
    fi \
 && rm -rf /wheelhouse /root/.cache \
 && /opt/zerosum/bin/python -c "from zerosum.warmup import warm_up; warm_up()"
# (the last step compiles the kernels into numba's cache inside the image)
ENV PATH=/opt/zerosum/bin:$PATH
COPY testbed/entrypoint.sh /usr/local/bin/zerosum-testbed
ENTRYPOINT ["zerosum-testbed"]
CMD ["worker"]
