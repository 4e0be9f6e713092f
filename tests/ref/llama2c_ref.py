# An independent llama2.c forward pass in numpy (float64, full recompute, no cache), used
# by tests/unit/test_generate_cli.sh to check `tandem generate --print-ids` end to end.
#   /usr/bin/python3 llama2c_ref.py MODEL.bin "PROMPT IDS" N_TOKENS  -> greedy ids
#   /usr/bin/python3 llama2c_ref.py MODEL.bin perplexity IDS_FILE CTX -> "PPL = X +/- Y"
#   (tests/unit/test_cli_perplexity.sh checks `tandem perplexity` with it)
import sys, struct, numpy as np
d=open(sys.argv[1],'rb').read()
dim,hid,L,nh,nkv,V,S=struct.unpack('7i',d[:28])
hs=dim//nh;kvd=nkv*hs
w=np.frombuffer(d[28:],dtype=np.float32).astype(np.float64)
o=0
def take(n,shape):
    global o
    a=w[o:o+n].reshape(shape); o+=n; return a
emb=take(V*dim,(V,dim)); ra=take(L*dim,(L,dim)); wq=take(L*dim*dim,(L,dim,dim)); wk=take(L*dim*kvd,(L,kvd,dim)); wv=take(L*dim*kvd,(L,kvd,dim)); wo=take(L*dim*dim,(L,dim,dim))
rf=take(L*dim,(L,dim)); w1=take(L*dim*hid,(L,hid,dim)); w2=take(L*dim*hid,(L,dim,hid)); w3=take(L*dim*hid,(L,hid,dim)); rfin=take(dim,(dim,))
def rms(x,g): return g*x/np.sqrt((x*x).mean(-1,keepdims=True)+1e-5)
def rope(x,pos):  # x [T,H,hs]
    fr=1.0/10000**(np.arange(0,hs,2)/hs); ang=pos[:,None]*fr[None,:]
    c=np.cos(ang)[:,None,:]; s=np.sin(ang)[:,None,:]
    x0=x[...,0::2]; x1=x[...,1::2]
    out=np.empty_like(x); out[...,0::2]=x0*c-x1*s; out[...,1::2]=x0*s+x1*c; return out
def forward(toks):
    T=len(toks); x=emb[toks]; pos=np.arange(T)
    for l in range(L):
        h=rms(x,ra[l]); q=(h@wq[l].T).reshape(T,nh,hs); k=(h@wk[l].T).reshape(T,nkv,hs); v=(h@wv[l].T).reshape(T,nkv,hs)
        q=rope(q,pos); k=rope(k,pos)
        k=np.repeat(k,nh//nkv,axis=1); v=np.repeat(v,nh//nkv,axis=1)
        att=np.einsum('thd,shd->hts',q,k)/np.sqrt(hs)
        att=att+np.triu(np.full((T,T),-1e30),1)[None]
        att=np.exp(att-att.max(-1,keepdims=True)); att/=att.sum(-1,keepdims=True)
        out=np.einsum('hts,shd->thd',att,v).reshape(T,dim)
        x=x+out@wo[l].T
        h=rms(x,rf[l]); a=h@w1[l].T; b=h@w3[l].T
        x=x+((a/(1+np.exp(-a)))*b)@w2[l].T
    return rms(x,rfin)@emb.T
if sys.argv[2]=='perplexity':
    # llama2c_ref.py MODEL.bin perplexity IDS_FILE CTX -> llama-perplexity's method on the ids
    # (BOS included): chunks of CTX tokens, each a fresh context starting with BOS (1), the
    # second half of each scored; "PPL = X +/- Y"
    ids=[int(t) for t in open(sys.argv[3]).read().split()]; ctx=int(sys.argv[4]); first=ctx//2
    nll=nll2=0.0; cnt=0
    for k in range(len(ids)//ctx):
        ch=[1]+ids[k*ctx+1:(k+1)*ctx]; lg=forward(ch)
        for i in range(first,ctx-1):
            m=lg[i].max(); v=-(lg[i][ch[i+1]]-m-np.log(np.exp(lg[i]-m).sum())); nll+=v; nll2+=v*v; cnt+=1
    nll/=cnt; nll2=nll2/cnt-nll*nll
    print("PPL = %.6f +/- %.6f" % (np.exp(nll), np.sqrt(nll2/(cnt-1))*np.exp(nll)))
    sys.exit(0)
toks=[int(t) for t in sys.argv[2].split()]; n0=len(toks)
for i in range(int(sys.argv[3])):
    lg=forward(toks); toks.append(int(lg[-1].argmax()))
print(" ".join(map(str, toks[n0:])))
