# CapyCTL: one image for every process of a role (redis, router, scheduler, hostd, memwatch).
#
#   docker build -t capyctl:local .          # from the repository root
#   docker run --rm capyctl:local capyctl --version
#
# The default command runs the whole standalone role in one container; compose/ runs each
# process in a container of its own from this same image (see docs/deploy.md).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# redis-server (and redis-cli, for health checks) from Debian, as `scripts/setup` does.
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*

# The non-root user that runs every process. The state dir is created here, owned by it and
# private (0700): a new named volume mounted on /var/lib/capyctl starts as a copy of it.
RUN groupadd --gid 1000 capyctl \
    && useradd --uid 1000 --gid capyctl --create-home --shell /usr/sbin/nologin capyctl \
    && install -d -o capyctl -g capyctl -m 0700 /var/lib/capyctl

# Every dependency pinned by requirements.lock, each file checked against its hash, then the
# seven packages of the monorepo (not editable) from a copy of the repository, with no
# dependency of their own beyond the lock's.
COPY . /tmp/capyctl-src
RUN pip install --require-hashes -r /tmp/capyctl-src/requirements.lock \
    && pip install --no-deps \
        /tmp/capyctl-src/libs/capycommon \
        /tmp/capyctl-src/libs/enginesim \
        /tmp/capyctl-src/services/router \
        /tmp/capyctl-src/services/scheduler \
        /tmp/capyctl-src/services/hostd \
        /tmp/capyctl-src/services/memwatch \
        /tmp/capyctl-src/cli \
    && rm -rf /tmp/capyctl-src \
    && capyctl --version

USER capyctl
WORKDIR /home/capyctl
ENV CAPYCTL_STATE_DIR=/var/lib/capyctl

EXPOSE 8443
CMD ["capyctl", "start", "standalone"]
