from tests.test_envoy_multinetwork import mesh, ECHO_VIP  # noqa
def test_dbg(mesh):
    import time; time.sleep(3)
    d = mesh.run("curl", "-sv", "--max-time", "5", "-H", "Host: echo.shop.svc.cluster.local", f"http://{ECHO_VIP}/cross")
    print("CURL", d.returncode, d.stdout, d.stderr[-1500:])
    print("GWSTATS", [l for l in mesh.gateway.get("/stats")[1].splitlines() if ("echo" in l or "15443" in l) and not l.endswith(": 0")][:40])
    print("CLSTATS", [l for l in mesh.client.get("/stats")[1].splitlines() if "echo" in l and ("ssl" in l or "cx_" in l) and not l.endswith(": 0")][:40])
    print("GWLOG", mesh.gateway.log()[-3000:])
    print("CLLOG", mesh.client.log()[-3000:])
