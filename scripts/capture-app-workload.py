#!/usr/bin/env python3
"""The `app` workload of scripts/capture-guest-memory.sh, run by the capture guest's init.

An application server's memory, unlike the `server` workload's page cache and text: a managed
runtime's heap (CPython objects: session records as dicts of strings, ints, floats and lists,
an LRU of rendered JSON responses, interned keys) beside an embedded database (SQLite on tmpfs
with indexes, and its page cache held in the process's heap). Sizes follow the guest's RAM.
Prints GUESTMEM-LOADED once everything is built, then keeps serving: each second it updates
and inserts rows, replaces sessions and responses, as a live application re-dirties memory.
Deterministic (seeded), so that two captures of the same RAM size hold the same kind of data.
"""
import collections
import json
import os
import random
import sqlite3
import sys
import time

MIB = 1 << 20


def mem_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def console(msg):
    print(f"guestmem: {msg}", file=sys.stderr, flush=True)


SERVICES = ["orders", "billing", "auth", "search", "inventory", "gateway", "shipping"]
CITIES = ["Lisbon", "Oslo", "Austin", "Osaka", "Nairobi", "Lima", "Pune", "Perth", "Tartu"]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def build_database(path, target_bytes, rng):
    """Users, products and orders with secondary indexes, until the file reaches its target."""
    db = sqlite3.connect(path)
    db.executescript("""
        PRAGMA page_size = 4096;
        PRAGMA journal_mode = WAL;
        CREATE TABLE users (id INTEGER PRIMARY KEY, email TEXT, name TEXT, city TEXT,
                            created INTEGER, balance REAL, flags INTEGER);
        CREATE TABLE products (id INTEGER PRIMARY KEY, sku TEXT, title TEXT, price REAL,
                               stock INTEGER);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, user_id INTEGER, product_id INTEGER,
                             qty INTEGER, total REAL, status TEXT, created INTEGER, note TEXT);
        CREATE INDEX orders_user ON orders(user_id, created);
        CREATE INDEX orders_status ON orders(status, created);
        CREATE INDEX users_email ON users(email);
    """)
    users = 50_000
    db.executemany("INSERT INTO users VALUES (?,?,?,?,?,?,?)", (
        (i, f"{rng.choice(WORDS)}.{rng.choice(WORDS)}{i}@example.com",
         f"{rng.choice(WORDS).title()} {rng.choice(WORDS).title()}", rng.choice(CITIES),
         1732450000 + rng.randrange(10**7), round(rng.random() * 5000, 2), rng.randrange(16))
        for i in range(1, users + 1)))
    db.executemany("INSERT INTO products VALUES (?,?,?,?,?)", (
        (i, f"SKU-{rng.randrange(10**8):08d}", " ".join(rng.choice(WORDS) for _ in range(4)),
         round(rng.random() * 300, 2), rng.randrange(1000)) for i in range(1, 20_001)))
    db.commit()
    order_id, batch = 1, 20_000
    while os.path.getsize(path) + os.path.getsize(path + "-wal") < target_bytes:
        rows = []
        for _ in range(batch):
            qty = rng.randrange(1, 6)
            rows.append((order_id, rng.randrange(1, users + 1), rng.randrange(1, 20_001), qty,
                         round(qty * rng.random() * 300, 2),
                         rng.choice(["new", "paid", "paid", "shipped", "shipped", "done"]),
                         1732450000 + order_id // 3,
                         " ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 9)))))
            order_id += 1
        db.executemany("INSERT INTO orders VALUES (?,?,?,?,?,?,?,?)", rows)
        db.commit()
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db, users, order_id


def permutation(rng):
    """A translation table that permutes the digits 1-9 and the letters A-F: applied to JSON
    text it keeps the text valid (no new leading zero, keys are lowercase) and makes its
    numbers and tokens other ones."""
    digits, letters = list("123456789"), list("ABCDEF")
    rng.shuffle(digits)
    rng.shuffle(letters)
    return str.maketrans("123456789ABCDEF", "".join(digits) + "".join(letters))


def session(i, rng):
    return {
        "id": i,
        "user": rng.randrange(1, 50_001),
        "token": f"{rng.getrandbits(128):032X}",
        "ip": f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}",
        "service": rng.choice(SERVICES),
        "started": 1732450000.0 + rng.random() * 86400,
        "hits": rng.randrange(1000),
        "cart": [rng.randrange(1, 20_001) for _ in range(rng.randrange(0, 12))],
        "prefs": {"lang": rng.choice(["en", "pt", "ja", "de"]), "theme": rng.choice(["dark", "light"])},
        "trail": [rng.choice(WORDS) for _ in range(rng.randrange(2, 10))],
    }


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--build-db":
        # On the host, at native speed (the guest runs under TCG): the database file the
        # initramfs carries, about a tenth of the guest's RAM.
        path, mb = sys.argv[2], int(sys.argv[3])
        build_database(path, mb * MIB * 10 // 100, random.Random(31))[0].close()
        return 0
    # APP_MIB and APP_DIR: a trial run on a host (the guest takes its RAM and /data).
    mb = int(os.environ.get("APP_MIB", "0")) or mem_mib()
    where = os.environ.get("APP_DIR", "/data")
    rng = random.Random(31)
    t0 = time.time()
    path = os.path.join(where, "app.db")
    if not os.path.exists(path):
        build_database(path, mb * MIB * 10 // 100, rng)[0].close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = WAL")
    users = db.execute("SELECT max(id) FROM users").fetchone()[0]
    next_order = db.execute("SELECT max(id) FROM orders").fetchone()[0] + 1
    # SQLite's page cache in the heap, filled by scanning the tables and indexes.
    db.execute(f"PRAGMA cache_size = -{mb * 1024 * 8 // 100}")
    for table in ("orders", "users", "products"):
        db.execute(f"SELECT count(*), sum(length(note)) FROM {table}" if table == "orders"
                   else f"SELECT count(*) FROM {table}").fetchall()
    db.execute("SELECT count(*) FROM orders INDEXED BY orders_user WHERE user_id > 0").fetchall()
    console(f"database built after {time.time() - t0:.0f} s")
    # The heap: sessions, and an LRU of rendered responses (JSON text of order lists).
    sessions = {}
    heap_target = mb * MIB * 22 // 100
    per_session = 1400
    # A block of sessions built in Python, then copied by the JSON parser (C speed: the guest is
    # emulated) through digit and hex-letter permutations, so that no two blocks hold the same
    # tokens, addresses or counts.
    block = json.dumps([session(i, rng) for i in range(2000)])
    n_sessions = heap_target * 2 // 3 // per_session
    while len(sessions) < n_sessions:
        for s in json.loads(block.translate(permutation(rng))):
            s["id"] = len(sessions)
            sessions[s["id"]] = s
    responses = collections.OrderedDict()
    rendered = []
    for _ in range(300):
        uid = rng.randrange(1, users + 1)
        rows = db.execute("SELECT id, product_id, qty, total, status, created FROM orders "
                          "WHERE user_id = ? LIMIT 40", (uid,)).fetchall()
        rendered.append(json.dumps({"user": uid, "orders": rows, "by": rng.choice(SERVICES)}))
    size, uid = 0, 0
    while size < heap_target // 3:
        table = permutation(rng)
        for text in rendered:
            uid += 1
            responses[uid] = text.translate(table)
            size += len(text) + 120
    console(f"heap filled after {time.time() - t0:.0f} s ({len(sessions)} sessions)")
    print("GUESTMEM-LOADED", flush=True)
    n = 0
    while True:
        n += 1
        for _ in range(40):
            db.execute("UPDATE orders SET status = ?, note = ? WHERE id = ?",
                       (rng.choice(["paid", "shipped", "done"]), rng.choice(WORDS),
                        rng.randrange(1, next_order)))
        db.executemany("INSERT INTO orders VALUES (?,?,?,?,?,?,?,?)", [
            (next_order + k, rng.randrange(1, users + 1), rng.randrange(1, 20_001), 1,
             round(rng.random() * 300, 2), "new", 1732450000 + n, rng.choice(WORDS))
            for k in range(10)])
        next_order += 10
        db.commit()
        for _ in range(200):
            i = rng.randrange(len(sessions))
            s = sessions[i]
            s["hits"] += 1
            s["trail"].append(rng.choice(WORDS))
            if len(s["trail"]) > 12:
                sessions[i] = session(i, rng)
        for _ in range(20):
            uid = rng.randrange(1, users + 1)
            responses.pop(uid, None)
            responses[uid] = json.dumps({"user": uid, "n": n, "served_by": rng.choice(SERVICES)})
            if len(responses) > 1:
                responses.popitem(last=False)
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
