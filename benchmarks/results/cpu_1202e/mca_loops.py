import re, subprocess, sys
from collections import Counter
src = sys.argv[1]
lines = open(src).read().split('\n')
labels = {l.rstrip(':'): i for i, l in enumerate(lines) if re.match(r'^\.L\d+:', l)}
seen = set()
for i, l in enumerate(lines):
    m = re.match(r'\s+j\w+\s+(\.L\d+)', l)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        body = lines[labels[m.group(1)]:i + 1]
        ins = [b for b in body if b.startswith('\t') and not b.startswith('\t.') and not re.match(r'\s+j', b)]
        c = Counter(b.split()[0] for b in ins)
        if c['vpmaddubsw'] == 32 and c['vcvtph2ps'] == 2 and c['vpmovzxbd'] == 0:
            key = (labels[m.group(1)])
            if key in seen: continue
            seen.add(key)
            open('/tmp/qt/mca_tmp.s', 'w').write('\n'.join(ins) + '\n')
            out = subprocess.run(['llvm-mca-15', '-mcpu=znver3', '-iterations=300', '/tmp/qt/mca_tmp.s'], capture_output=True, text=True).stdout
            cyc = int(re.search(r'Total Cycles:\s+(\d+)', out).group(1)) / 300
            rt = re.search(r'Block RThroughput:\s+([\d.]+)', out).group(1)
            stack = sum(('rsp' in b or 'rbp' in b) for b in ins)
            print(f'{src}: loop {m.group(1)} instrs {len(ins)} stack-refs {stack} cycles/iter {cyc:.1f} rthru {rt}')
