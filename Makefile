# The README's two commands are `make run` and `make test`; both set up .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.installed-base# istiod and what it needs to run: all `make run` installs
STAMP  := $(VENV)/.installed# plus the test extras
CHROMIUM := /usr/bin/chromium
SUDO     := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: run test unit e2e e2e-bin helm-bin istio-bin bench-bin ztunnel-bin protoc-bin bench protos annotations demo-server demo-client demo-sidecars chromium netns-tools clean

# pip without --quiet: the first install takes a minute or two, and shows what it is doing.
$(BASE): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH"; exit 1; }
	@echo "==> creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> installing istiod and its dependencies into $(VENV)"
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e .
	touch $(BASE)

$(STAMP): $(BASE)
	@echo "==> installing the test tools into $(VENV)"
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

# An explicit --config-dir: KUBECONFIG in the environment does not turn this into cluster mode. The
# README's `istiod agent` walkthrough dials 127.0.0.1:15012 with deploy/demo-ca's token: the demo's
# certificate names that IP, and its CA takes that token (a stand-in for TokenReview, demo only).
RUN_ARGS := --config-dir deploy/demo --ca-static-tokens deploy/demo-ca/tokens.json --tls-extra-san 127.0.0.1 --tls-extra-san localhost
run: $(BASE)
	$(BIN)/istiod discovery $(RUN_ARGS)

# -rfEs: the summary names every failure, error and skip (with its reason). tests/ and e2e/ run as
# two sessions, so that an end of the first, even a crash, still lets e2e/ run; either failing fails.
PYTEST := $(BIN)/pytest -q -rfEs

test: $(STAMP) $(CHROMIUM) netns-tools e2e-bin helm-bin istio-bin bench-bin ztunnel-bin
	status=0; $(PYTEST) tests || status=1; $(PYTEST) e2e || status=1; exit $$status

unit: $(STAMP) $(CHROMIUM) netns-tools helm-bin istio-bin ztunnel-bin
	$(PYTEST) tests

# Headless Chromium renders /debug/ui in the tests: Debian's package, installed once.
chromium: $(CHROMIUM)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core

# Pods with sidecars are network namespaces with istio-init's capture: Debian's iptables, iproute2,
# setpriv (util-linux) and curl (Envoy's admin inside a pod), installed when one is missing. Only as
# root: without root the pod tests skip, so there is nothing to install.
NETNS_TOOLS := iptables-restore ip setpriv curl
netns-tools:
	@for tool in $(NETNS_TOOLS); do command -v $$tool >/dev/null || missing=yes; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables iproute2 util-linux curl; \
	fi

# The real kube-apiserver and etcd for e2e/, built with Go from the module proxy; reused when present.
e2e-bin:
	@bash e2e/cluster/build.sh

# The real helm for the chart tests (tests/test_charts.py), built and reused the same way.
helm-bin:
	@bash e2e/cluster/build-helm.sh

# Istio's own istioctl and pilot-agent for the drop-in tests (they run against our istiod), built and
# reused the same way (e2e/cluster/istio/go.mod pins istio.io/istio).
istio-bin:
	@bash e2e/cluster/build-istio.sh

# The real ztunnel for the ambient tests, built by the shared script beside the clone (Rust: 4-5 min
# cold on 2 cores, then cached machine-wide) and linked where tests/ztunnel_peer.py's ztunnel_binary() looks.
ZTUNNEL_BUILD ?= $(firstword $(wildcard ../shared/ztunnel/build.sh ../../shared/ztunnel/build.sh) ../shared/ztunnel/build.sh)
ztunnel-bin: protoc-bin
	@[ -f "$(ZTUNNEL_BUILD)" ] || { echo "ztunnel-bin: no $(ZTUNNEL_BUILD) (the ztunnel build script and source tarball beside this clone); name it with ZTUNNEL_BUILD=/path/to/ztunnel/build.sh"; exit 1; }
	@path=$$(bash "$(ZTUNNEL_BUILD)") && mkdir -p .cache/ztunnel-bin && ln -sfn "$$path" .cache/ztunnel-bin/ztunnel && echo "ztunnel: $$path"

# ztunnel's build compiles its protos: Debian's protobuf-compiler, installed when missing (as root).
protoc-bin:
	@command -v protoc >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends protobuf-compiler; }

# The load benchmark's compiled generator (bench/loadgen-go), built and reused the same way.
bench-bin:
	@bash bench/loadgen-go/build.sh

e2e: $(STAMP) e2e-bin
	$(PYTEST) e2e

demo-server: $(BASE)
	$(BIN)/python -m istiod.demo server --address 127.0.0.10:7070 --name echo-v1

# Calls until stopped (Ctrl-C), so edits under deploy/demo/ show in its output.
demo-client: $(BASE)
	$(BIN)/python -m istiod.demo client xds:///echo.demo.svc.cluster.local:7070 --xds 127.0.0.1:15010 --count 0

# Two pods with Envoy sidecars (network namespaces, so root only) and a call from one to the other.
demo-sidecars: $(STAMP) netns-tools
	$(BIN)/python -m istiod.demo.sidecars

bench: $(STAMP)
	$(BIN)/python bench/push.py
	$(BIN)/python bench/configdir.py
	$(BIN)/python bench/config.py
	$(BIN)/python bench/analysis.py
	$(BIN)/python bench/wds.py
	$(BIN)/python bench/connmem.py
	$(BIN)/python bench/connect.py
	$(BIN)/pip install --quiet -e '.[bench]'
	@bash bench/loadgen-go/build.sh || echo "bench: no Go: the load benchmark's clients run in Python processes"
	$(BIN)/python bench/load.py
	@if bash e2e/cluster/build.sh; then $(BIN)/python bench/load.py --source kube; \
	else echo "bench: no kube-apiserver and etcd (make e2e-bin needs Go): the kube source is skipped"; fi

# Generated code is committed; tests/test_protos.py fails when it is stale.
PROTOS := $(shell find api -name '*.proto')
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iistiod/gen=api --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

# Istio's annotation table for the analyzers, from the istio.io/api module in the Go module cache.
annotations: $(STAMP)
	$(BIN)/python api/annotations/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
