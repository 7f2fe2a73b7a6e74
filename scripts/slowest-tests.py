#!/usr/bin/env python3
"""The slowest tests of the last `cargo nextest run --profile ci` (its JUnit report), slowest first:
where the test step's time goes. Usage: scripts/slowest-tests.py [COUNT] [REPORT]"""
import sys
import xml.etree.ElementTree as ET

count = int(sys.argv[1]) if len(sys.argv) > 1 else 15
report = sys.argv[2] if len(sys.argv) > 2 else "target/nextest/ci/junit.xml"
try:
    cases = ET.parse(report).getroot().iter("testcase")
except (OSError, ET.ParseError) as e:
    sys.exit(f"slowest-tests: no report at {report} ({e})")
times = sorted(((float(c.get("time", 0)), f"{c.get('classname')} {c.get('name')}") for c in cases), reverse=True)
total = sum(t for t, _ in times)
print(f"slowest {min(count, len(times))} of {len(times)} tests ({total / 60:.1f} min of test time in all):")
for t, name in times[:count]:
    print(f"  {t:7.1f}s  {name}")
