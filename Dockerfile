# LightGate in a container: `lightgate serve`, the embedded node (docs/operations.md#docker).
#
#   docker build -t lightgate .
#   docker run -d --name lightgate -p 1883:1883 -p 18083:18083 -v lightgate-data:/var/lib/lightgate lightgate
#
# Configuration: mount a lightgate.toml at /etc/lightgate/lightgate.toml (the working directory),
# e.g. with admin.token set: the admin API listens on all interfaces here. Flags after the image
# name replace the default command: docker run ... lightgate serve --port 1884 ...
# Not built by the test suite (no Docker engine on the machines it runs on): tests/test_packaging.py
# checks what it can without one (COPY sources, flags, ports, the health check's URL).

# Stage 1: the wheels of LightGate and its base dependencies (all have binary wheels: no compiler).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in ./
COPY gateway gateway
COPY store store
COPY lightqueue lightqueue
COPY notify notify
COPY retain retain
COPY spark_analytics spark_analytics
RUN python -m pip wheel --no-cache-dir --wheel-dir /wheels .

# Stage 2: the base install in a virtual environment, run by an unprivileged user.
FROM python:3.11-slim
RUN useradd --system --uid 1883 --home-dir /var/lib/lightgate --shell /usr/sbin/nologin lightgate \
    && mkdir -p /var/lib/lightgate /etc/lightgate \
    && chown lightgate:lightgate /var/lib/lightgate
COPY --from=build /wheels /wheels
RUN python -m venv /opt/lightgate \
    && /opt/lightgate/bin/pip install --no-cache-dir --no-index --find-links /wheels lightgate \
    && rm -rf /wheels
ENV PATH=/opt/lightgate/bin:$PATH
USER lightgate
WORKDIR /etc/lightgate
VOLUME /var/lib/lightgate
EXPOSE 1883 18083
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["/opt/lightgate/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18083/healthz', timeout=2)"]
ENTRYPOINT ["lightgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "1883", "--admin-host", "0.0.0.0", "--admin-port", "18083", "--data", "/var/lib/lightgate"]
