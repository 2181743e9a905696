"""The README's code blocks: every ```python block compiles, and the quickstart runs as written
(as an application role with only USAGE on the schema), printing what the README shows; the
README's look at the record (`lookup`) works for that role."""

import os
import re
import subprocess
import sys

import psycopg
import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def blocks(lang):
    text = open(README, encoding="utf-8").read()
    return re.findall(r"^```" + lang + r"\n(.*?)^```", text, re.S | re.M)


@pytest.mark.parametrize("n", range(len(blocks("python"))))
def test_every_python_block_compiles(n):
    compile(blocks("python")[n], f"README.md python block {n + 1}", "exec")


def test_the_quickstart_runs_as_written(cluster, endpoint, db, tmp_path):
    db.execute("DO $$ BEGIN CREATE ROLE readme_app LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    db.execute("GRANT USAGE ON SCHEMA idempotency TO readme_app")
    quickstart = blocks("python")[0]
    assert "send_receipt(42" in quickstart
    (tmp_path / "quickstart.py").write_text(quickstart)
    env = dict(os.environ, PGHOST=endpoint["host"], PGPORT=endpoint["port"], PGDATABASE=endpoint["dbname"],
               PGUSER="readme_app")
    outs = [subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60) for _ in range(2)]
    assert [o.returncode for o in outs] == [0, 0], outs
    shown = re.search(r"\$ PGHOST=.*? python quickstart.py\n(.*?)\$ PGHOST=.*? python quickstart.py\n(.*?)```",
                      open(README, encoding="utf-8").read(), re.S)
    assert [o.stdout for o in outs] == [shown.group(1), shown.group(2)]
    # The README's look at the record, as the same role.
    sql = re.search(r'psql -d shop -c "(SELECT [^"]*lookup[^"]*)"', open(README, encoding="utf-8").read()).group(1)
    with psycopg.connect(cluster.conninfo().replace("user=postgres", "user=readme_app"), autocommit=True) as conn:
        assert conn.execute(sql).fetchall() == [("receipt:42", "completed", {"sent_to": "alice@example.com",
                                                                              "order_id": 42})]
