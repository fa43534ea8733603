"""Issue 21 probe (GPU): candidate inner loops of the quantized GEMV, streaming a Q4_K matrix at the 27B input width
(17408 x 8 rows of 5120: 91.9 MB). Prints, per tokens per launch, GB/s per loop next to a plain read of the same bytes:
  mma: bf16 levels (magic number) on mma.m16n8k16, 16-row items, rows of planes (per row: 16 bytes of nibbles per
       32-element unit, then 16 bytes of scales per 256), scales applied per unit;
  dp4a2: the inputs as two int8 planes per 32 (x = d (q1 + q2 / 256)), 4-row items, one lane per unit (the
       megakernel's loop today, less its ring and butterfly);
  imma: the same two planes on the int8 tensor cores, mma.m16n8k32.s8, with the weights in fragment order: per
       16-row tile and unit, lane (g, t) holds 4 bytes of row g and 4 of row g + 8, each byte's low nibble the
       level at k = 4t + i, its high nibble k = 16 + 4t + i, so the A fragment is two masks per row. The
       B columns are (token, plane) pairs, so up to 4 tokens take one mma and its epilogue per lane is one token
       of two rows, whatever T is up to 4;
  immai: imma with the inputs quantized per 256 instead of 32 (one d per super-block and token), so the sub-block
       scales and mins multiply in integers and the floats come once per super-block.
Usage: python3 tools/gpu/qmma_probe.py [T ...]   (default: 1 2 4; the staged inputs are static shared memory, so T <= 4)."""

import sys

import cupy as cp

SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ u32 lop(u32 a, u32 m, u32 c){u32 d; asm("lop3.b32 %0,%1,%2,%3,0xEA;":"=r"(d):"r"(a),"r"(m),"r"(c)); return d;}
__device__ __forceinline__ u32 ldcs32(const void* p){u32 r; asm volatile("ld.global.cs.u32 %0,[%1];":"=r"(r):"l"(p)); return r;}
__device__ __forceinline__ uint4 ldcs128(const void* p){uint4 r; asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3},[%4];":"=r"(r.x),"=r"(r.y),"=r"(r.z),"=r"(r.w):"l"(p)); return r;}
__device__ __forceinline__ void mma(float (&d)[4], u32 a0,u32 a1,u32 a2,u32 a3,u32 b0,u32 b1){
 asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3},{%4,%5,%6,%7},{%8,%9},{%0,%1,%2,%3};"
  :"+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]):"r"(a0),"r"(a1),"r"(a2),"r"(a3),"r"(b0),"r"(b1));}
__device__ __forceinline__ float u2f(u32 v){ return __uint_as_float(v | 0x4B000000u) - 8388608.0f; }
__device__ __forceinline__ float h2f(u32 h){ float f; asm("cvt.f32.f16 %0,%1;":"=f"(f):"h"((unsigned short)h)); return f; }
extern "C" __global__ void __launch_bounds__(384,1) rd(const uint4* w, long n, float* out){
  u32 s=0; for(long i=blockIdx.x*384+threadIdx.x;i<n;i+=(long)gridDim.x*384){uint4 v=ldcs128(w+i); s^=v.x^v.y^v.z^v.w;}
  if(s==0x12345) out[0]=s;}
#define K 5120
#define NUN (K/32)
#define ROWB (NUN*16 + K/256*16)
// ---- mma: warp item = 16 rows x all units, steps of one super-block (8 units) double-buffered -------------
struct MStep { u32 a[8], b[8]; uint4 sa, sb; };
__device__ __forceinline__ void mload(const unsigned char* r0, const unsigned char* r1, int sb, int t, MStep& s){
  #pragma unroll
  for(int j=0;j<8;++j){ s.a[j]=ldcs32(r0+(sb*8+j)*16+4*t); s.b[j]=ldcs32(r1+(sb*8+j)*16+4*t); }
  s.sa=ldcs128(r0+NUN*16+sb*16); s.sb=ldcs128(r1+NUN*16+sb*16);
}
template<int J> __device__ __forceinline__ void kscale(const uint4& s, float& a, float& b){
  const u32 byte=(u32)((((unsigned long long)s.z<<32)|s.y)>>(8*J))&0xFFu;
  const u32 sc=byte&63u, m=(byte>>6)|(((s.w>>(4*J))&0xFu)<<2);
  a=h2f(s.x&0xFFFF)*u2f(sc); b=fmaf(128.f, a, h2f(s.x>>16)*u2f(m));
}
extern "C" __global__ void __launch_bounds__(384,1) mmaq(const unsigned char* w, int rows, float* out){
  const int lane=threadIdx.x&31, g=lane>>2, t=lane&3;
  const int warps=gridDim.x*12, wid=blockIdx.x*12+(threadIdx.x>>5);
  __shared__ uint4 xs[NT][K/8]; __shared__ float xsum[NT][NUN];
  for(int i=threadIdx.x;i<NT*K/8;i+=384) (&xs[0][0])[i]=make_uint4(0x3f803f80u+i,0x3f80u,0x3f803f80u,0x3f80u);
  for(int i=threadIdx.x;i<NT*NUN;i+=384) (&xsum[0][0])[i]=1.0f+i;
  __syncthreads();
  const int tk=min(g, NT-1), t0=min(2*t, NT-1), t1=min(2*t+1, NT-1);
  const u32 M=0x000F000Fu, C=0x43004300u;
  float tot=0.f;
  for(int tile=wid; tile<rows/16; tile+=warps){
    const unsigned char* r0=w+(long)(tile*16+g)*ROWB; const unsigned char* r1=r0+(long)8*ROWB;
    float acc[4]={0,0,0,0};
    MStep s[2];
    mload(r0,r1,0,t,s[0]);
    #pragma unroll 1
    for(int sb=0; sb<K/256; sb+=2){
      #pragma unroll
      for(int h=0;h<2;++h){
        if(sb+h+1<K/256) mload(r0,r1,sb+h+1,t,s[h^1]);
        const MStep& c=s[h];
        #pragma unroll
        for(int j=0;j<8;++j){
          const int v=(sb+h)*8+j;
          const uint4 xq=xs[tk][v*4+t];
          u32 b00,b01,b10,b11;
          asm("prmt.b32 %0,%1,%2,0x5410;":"=r"(b00):"r"(xq.x),"r"(xq.z)); asm("prmt.b32 %0,%1,%2,0x7632;":"=r"(b01):"r"(xq.x),"r"(xq.z));
          asm("prmt.b32 %0,%1,%2,0x5410;":"=r"(b10):"r"(xq.y),"r"(xq.w)); asm("prmt.b32 %0,%1,%2,0x7632;":"=r"(b11):"r"(xq.y),"r"(xq.w));
          float d[4]={0,0,0,0};
          const u32 a=c.a[j], b=c.b[j];
          mma(d, lop(a,M,C), lop(b,M,C), lop(a>>4,M,C), lop(b>>4,M,C), b00, b01);
          mma(d, lop(a>>8,M,C), lop(b>>8,M,C), lop(a>>12,M,C), lop(b>>12,M,C), b10, b11);
          float aa,ba,ab,bb;
          switch(j){
#define KS(J) case J: kscale<J>(c.sa,aa,ba); kscale<J>(c.sb,ab,bb); break;
            KS(0) KS(1) KS(2) KS(3) KS(4) KS(5) KS(6) KS(7)
          }
          const float x0=xsum[t0][v];
          acc[0]=fmaf(aa,d[0],acc[0]); acc[0]=fmaf(-ba,x0,acc[0]);
          acc[2]=fmaf(ab,d[2],acc[2]); acc[2]=fmaf(-bb,x0,acc[2]);
          if(NT>1){ const float x1=xsum[t1][v];
            acc[1]=fmaf(aa,d[1],acc[1]); acc[1]=fmaf(-ba,x1,acc[1]);
            acc[3]=fmaf(ab,d[3],acc[3]); acc[3]=fmaf(-bb,x1,acc[3]); }
        }
      }
    }
    tot+=acc[0]+acc[1]+acc[2]+acc[3];
  }
  if(tot==1.2345f) out[0]=tot;
}
// ---- dp4a2: item = 4 rows x 32 units (one per lane), double-buffered items -----------------------------
struct DItem { uint4 n[4], s[4]; };
extern "C" __global__ void __launch_bounds__(384,1) dp4a2(const unsigned char* w, int rows, float* out){
  const int lane=threadIdx.x&31;
  const int warps=gridDim.x*12, wid=blockIdx.x*12+(threadIdx.x>>5);
  __shared__ uint4 x8[NT][NUN*4];   // per unit: plane 1 (32 B), plane 2 (32 B)
  __shared__ float2 xd[NT][NUN];    // per unit: d, sum x
  for(int i=threadIdx.x;i<NT*NUN*4;i+=384) (&x8[0][0])[i]=make_uint4(0x01020304u*i,0x7f7f0101u,0x80808080u+i,0x01010101u);
  for(int i=threadIdx.x;i<NT*NUN;i+=384) (&xd[0][0])[i]=make_float2(0.01f*i, 1.0f);
  __syncthreads();
  const int chunks=NUN/32, items=rows/4*chunks;
  float tot=0.f;
  auto load=[&](int it, DItem& d){
    const int rg=it/chunks, ch=it-rg*chunks, v=ch*32+lane;
    #pragma unroll
    for(int h=0;h<4;++h){ const unsigned char* r=w+(long)(rg*4+h)*ROWB;
      d.n[h]=ldcs128(r+v*16); d.s[h]=ldcs128(r+NUN*16+(v>>3)*16); }
  };
  DItem ib[2];
  int it=wid; if(it<items) load(it, ib[0]);
  #pragma unroll 1
  for(; it<items; it+=2*warps){
    #pragma unroll
    for(int p=0;p<2;++p){
      const int cur=it+p*warps; if(cur>=items) break;
      if(cur+warps<items) load(cur+warps, ib[p^1]);
      const DItem& d=ib[p];
      const int rg=cur/chunks, ch=cur-rg*chunks, v=ch*32+lane, j=v&7;
      float acc[4][NT];
      #pragma unroll
      for(int h=0;h<4;++h){
        const u32 wv[4]={d.n[h].x,d.n[h].y,d.n[h].z,d.n[h].w};
        u32 lo[4], hi[4];
        #pragma unroll
        for(int q=0;q<4;++q){ lo[q]=wv[q]&0x0F0F0F0Fu; hi[q]=(wv[q]>>4)&0x0F0F0F0Fu; }
        const u32 byte=(u32)((((unsigned long long)d.s[h].z<<32)|d.s[h].y)>>(8*j))&0xFFu;
        const u32 sc=byte&63u, m=(byte>>6)|(((d.s[h].w>>(4*j))&0xFu)<<2);
        const float a=h2f(d.s[h].x&0xFFFF)*u2f(sc)*(1.0f/256), b=h2f(d.s[h].x>>16)*u2f(m);
        #pragma unroll
        for(int tk=0;tk<NT;++tk){
          const uint4 p0=x8[tk][v*4], p1=x8[tk][v*4+1], q0=x8[tk][v*4+2], q1=x8[tk][v*4+3];
          int s1=0, s2=0;
          s1=__dp4a((int)lo[0],(int)p0.x,s1); s1=__dp4a((int)hi[0],(int)p0.y,s1); s1=__dp4a((int)lo[1],(int)p0.z,s1); s1=__dp4a((int)hi[1],(int)p0.w,s1);
          s1=__dp4a((int)lo[2],(int)p1.x,s1); s1=__dp4a((int)hi[2],(int)p1.y,s1); s1=__dp4a((int)lo[3],(int)p1.z,s1); s1=__dp4a((int)hi[3],(int)p1.w,s1);
          s2=__dp4a((int)lo[0],(int)q0.x,s2); s2=__dp4a((int)hi[0],(int)q0.y,s2); s2=__dp4a((int)lo[1],(int)q0.z,s2); s2=__dp4a((int)hi[1],(int)q0.w,s2);
          s2=__dp4a((int)lo[2],(int)q1.x,s2); s2=__dp4a((int)hi[2],(int)q1.y,s2); s2=__dp4a((int)lo[3],(int)q1.z,s2); s2=__dp4a((int)hi[3],(int)q1.w,s2);
          const float2 dd=xd[tk][v];
          acc[h][tk]=fmaf(a*dd.x, (float)(s1*256+s2), -b*dd.y);
        }
      }
      #pragma unroll
      for(int h=0;h<4;++h)
        #pragma unroll
        for(int tk=0;tk<NT;++tk) tot+=acc[h][tk];  // the real loop's butterfly (7 shuffles per token) left out
    }
  }
  if(tot==1.2345f) out[0]=tot;
}
// ---- imma: warp item = one 16-row tile, steps of one super-block double-buffered ---------------------------
// Tile layout per super-block: 8 units x 256 bytes of fragments (lane l: 8 bytes at 8 l), then the 16 rows' 16-byte
// scales (the rows-of-planes scale bytes, as mmaq reads them).
#define TSB (8 * 256 + 16 * 16)
struct IStep { uint2 a[8]; uint4 sa, sb; };
__device__ __forceinline__ uint2 ldcs64(const void* p){uint2 r; asm volatile("ld.global.cs.v2.u32 {%0,%1},[%2];":"=r"(r.x),"=r"(r.y):"l"(p)); return r;}
__device__ __forceinline__ void iload(const unsigned char* tile, int sb, int lane, int g, IStep& s){
  const unsigned char* b=tile+(long)sb*TSB;
  #pragma unroll
  for(int j=0;j<8;++j) s.a[j]=ldcs64(b+j*256+8*lane);
  s.sa=ldcs128(b+8*256+g*16); s.sb=ldcs128(b+8*256+(g+8)*16);
}
__device__ __forceinline__ void imma(int (&d)[4], u32 a0,u32 a1,u32 a2,u32 a3,u32 b0,u32 b1){
 asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3},{%4,%5,%6,%7},{%8,%9},{%0,%1,%2,%3};"
  :"+r"(d[0]),"+r"(d[1]),"+r"(d[2]),"+r"(d[3]):"r"(a0),"r"(a1),"r"(a2),"r"(a3),"r"(b0),"r"(b1));}
#define NG ((NT + 3) / 4)  // token groups of 4: one mma each
// Each warp's tiles, every super-block of a tile in order with the next one loading: step(c, sb, acc) adds super-block
// sb (its loaded bytes c) to the lane's sums of rows g and g + 8, acc[token group][row]. Returns the lane's total.
template <class Step>
__device__ __forceinline__ float tile_walk(const unsigned char* w, int rows, Step step){
  const int lane=threadIdx.x&31, g=lane>>2;
  const int warps=gridDim.x*12, wid=blockIdx.x*12+(threadIdx.x>>5);
  float tot=0.f;
  for(int tile=wid; tile<rows/16; tile+=warps){
    const unsigned char* base=w+(long)tile*16*ROWB;
    float acc[NG][2];
    #pragma unroll
    for(int q=0;q<NG;++q){ acc[q][0]=0.f; acc[q][1]=0.f; }
    IStep s[2];
    iload(base,0,lane,g,s[0]);
    #pragma unroll 1
    for(int sb=0; sb<K/256; sb+=2){
      #pragma unroll
      for(int h=0;h<2;++h){
        if(sb+h+1<K/256) iload(base,sb+h+1,lane,g,s[h^1]);
        step(s[h], sb+h, acc);
      }
    }
    #pragma unroll
    for(int q=0;q<NG;++q) tot+=acc[q][0]+acc[q][1];
  }
  return tot;
}
extern "C" __global__ void __launch_bounds__(384,1) immaq(const unsigned char* w, int rows, float* out){
  const int lane=threadIdx.x&31, g=lane>>2, t=lane&3;
  __shared__ u32 x8[NT][NUN][2][8];  // per token and unit: plane 1, plane 2 (32 int8 each)
  __shared__ float2 xd[NT][NUN];     // per token and unit: d, sum x
  for(int i=threadIdx.x;i<NT*NUN*16;i+=384) (&x8[0][0][0][0])[i]=0x01020304u*i;
  for(int i=threadIdx.x;i<NT*NUN;i+=384) (&xd[0][0])[i]=make_float2(0.01f*i, 1.0f);
  __syncthreads();
  int btok[NG], etok[NG];  // the token whose plane this lane's B column holds; the token of its C columns
  #pragma unroll
  for(int q=0;q<NG;++q){ btok[q]=min(4*q+(g>>1), NT-1); etok[q]=min(4*q+t, NT-1); }
  const u32 M=0x0F0F0F0Fu;
  const float tot=tile_walk(w, rows, [&](const IStep& c, int sb, float (&acc)[NG][2]){
        #pragma unroll
        for(int j=0;j<8;++j){
          const int v=sb*8+j;
          const u32 a0=c.a[j].x&M, a2=(c.a[j].x>>4)&M, a1=c.a[j].y&M, a3=(c.a[j].y>>4)&M;
          float ag,bg,a8,b8;
          switch(j){
#define IS(J) case J: kscale<J>(c.sa,ag,bg); kscale<J>(c.sb,a8,b8); break;
            IS(0) IS(1) IS(2) IS(3) IS(4) IS(5) IS(6) IS(7)
          }
          #pragma unroll
          for(int q=0;q<NG;++q){
            const u32* xb=x8[btok[q]][v][g&1];
            int d[4]={0,0,0,0};
            imma(d, a0, a1, a2, a3, xb[t], xb[4+t]);
            const float2 dd=xd[etok[q]][v];
            const float sg=(float)(d[0]*256+d[1]), s8=(float)(d[2]*256+d[3]);
            acc[q][0]=fmaf(ag*dd.x, sg, fmaf(-bg, dd.y, acc[q][0]));
            acc[q][1]=fmaf(a8*dd.x, s8, fmaf(-b8, dd.y, acc[q][1]));
          }
        }
  });
  if(tot==1.2345f) out[0]=tot;
}
// ---- immai: immaq with the inputs quantized per 256 (one d per super-block and token), so the sub-block scales
// and mins multiply in integers and the floats come once per super-block. The scale bytes as mmaq reads them:
// bytes 4..11 hold sc (low 6 bits) and m's low 2 bits (high 2), bytes 12..15 m's high 4 bits as nibbles.
__device__ __forceinline__ u32 byte_of(u32 w, int j){ u32 r; asm("prmt.b32 %0,%1,0,%2;":"=r"(r):"r"(w),"r"(0x4440u|j)); return r; }
extern "C" __global__ void __launch_bounds__(384,1) immai(const unsigned char* w, int rows, float* out){
  const int lane=threadIdx.x&31, g=lane>>2, t=lane&3;
  __shared__ uint2 x8[NT][NUN][2][4];  // per token and unit: planes 1 and 2 in B-fragment order (lane t: 8 bytes)
  __shared__ int xq[NT][NUN];         // per token and unit: sum (256 q1 + q2)
  __shared__ float xd[NT][K/256];     // per token and super-block: d
  for(int i=threadIdx.x;i<NT*NUN*8;i+=384) (&x8[0][0][0][0])[i]=make_uint2(0x01020304u*i, 0x7f010203u+i);
  for(int i=threadIdx.x;i<NT*NUN;i+=384) (&xq[0][0])[i]=i*17-900;
  for(int i=threadIdx.x;i<NT*K/256;i+=384) (&xd[0][0])[i]=0.01f*i;
  __syncthreads();
  int btok[NG], etok[NG];
  #pragma unroll
  for(int q=0;q<NG;++q){ btok[q]=min(4*q+(g>>1), NT-1); etok[q]=min(4*q+t, NT-1); }
  const u32 M=0x0F0F0F0Fu;
  const float tot=tile_walk(w, rows, [&](const IStep& c, int sb, float (&acc)[NG][2]){
        // sc bytes and m bytes of the 8 units, per row (g: sa, g + 8: sb)
        const u32 scg0=c.sa.y&0x3F3F3F3Fu, scg1=c.sa.z&0x3F3F3F3Fu, sc80=c.sb.y&0x3F3F3F3Fu, sc81=c.sb.z&0x3F3F3F3Fu;
        u32 mg[2], m8[2];
        #pragma unroll
        for(int r=0;r<2;++r){
          const uint4& sv=r?c.sb:c.sa; u32* mm=r?m8:mg;
          #pragma unroll
          for(int half=0;half<2;++half){
            const u32 lo=((half?sv.z:sv.y)>>6)&0x03030303u, nib=(sv.w>>(16*half))&0xFFFFu;
            const u32 spread=((nib&0xFu)|((nib&0xF0u)<<4)|((nib&0xF00u)<<8)|((nib&0xF000u)<<12));
            mm[half]=lo|(spread<<2);
          }
        }
        int pi[NG][4], mi[NG][2];
        #pragma unroll
        for(int q=0;q<NG;++q){ pi[q][0]=pi[q][1]=pi[q][2]=pi[q][3]=0; mi[q][0]=mi[q][1]=0; }
        #pragma unroll
        for(int j=0;j<8;++j){
          const int v=sb*8+j;
          const u32 a0=c.a[j].x&M, a2=(c.a[j].x>>4)&M, a1=c.a[j].y&M, a3=(c.a[j].y>>4)&M;
          const int scg=(int)byte_of(j<4?scg0:scg1, j&3), sc8=(int)byte_of(j<4?sc80:sc81, j&3);
          const int mgj=(int)byte_of(mg[j>>2], j&3), m8j=(int)byte_of(m8[j>>2], j&3);
          #pragma unroll
          for(int q=0;q<NG;++q){
            const uint2 xb=x8[btok[q]][v][g&1][t];
            int d[4]={0,0,0,0};
            imma(d, a0, a1, a2, a3, xb.x, xb.y);
            pi[q][0]+=scg*d[0]; pi[q][1]+=scg*d[1]; pi[q][2]+=sc8*d[2]; pi[q][3]+=sc8*d[3];
            const int qs=xq[etok[q]][v];
            mi[q][0]+=mgj*qs; mi[q][1]+=m8j*qs;
          }
        }
        const float dg=h2f(c.sa.x&0xFFFF), dmg=h2f(c.sa.x>>16), d8=h2f(c.sb.x&0xFFFF), dm8=h2f(c.sb.x>>16);
        #pragma unroll
        for(int q=0;q<NG;++q){
          const float dx=xd[etok[q]][sb];
          const float sg=fmaf((float)pi[q][0], 256.f, (float)pi[q][1]), s8=fmaf((float)pi[q][2], 256.f, (float)pi[q][3]);
          acc[q][0]=fmaf(dg*dx, sg, fmaf(-dmg*dx, (float)mi[q][0], acc[q][0]));
          acc[q][1]=fmaf(d8*dx, s8, fmaf(-dm8*dx, (float)mi[q][1], acc[q][1]));
        }
  });
  if(tot==1.2345f) out[0]=tot;
}
"""


def main() -> None:
    tokens = [int(a) for a in sys.argv[1:]] or [1, 2, 4]
    rows = 17408 * 8
    rowb = 5120 // 32 * 16 + 5120 // 256 * 16
    w = cp.random.randint(0, 2**31, size=rows * rowb // 4, dtype=cp.int32).view(cp.uint8)
    out = cp.zeros(4, cp.float32)
    nbytes = w.nbytes
    print(f"{device_name()}: {rows} rows x 5120, {nbytes / 1e6:.1f} MB of Q4_K", flush=True)

    def timeit(nt, name, f):
        f()
        cp.cuda.runtime.deviceSynchronize()
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        ev0.record()
        n = 20
        for _ in range(n):
            f()
        ev1.record()
        ev1.synchronize()
        ms = cp.cuda.get_elapsed_time(ev0, ev1) / n
        print(f"T={nt} {name}: {ms:.4f} ms, {nbytes / ms / 1e6:.0f} GB/s", flush=True)

    for nt in tokens:
        mod = cp.RawModule(code=f"#define NT {nt}\n" + SRC, options=("--std=c++17",))
        for name in ("mmaq", "dp4a2", "immaq", "immai"):
            k = mod.get_function(name)
            print(f"T={nt} {name}: regs {k.num_regs}, local {k.local_size_bytes} B", flush=True)
        rd = mod.get_function("rd")
        timeit(nt, "plain read", lambda rd=rd: rd((132,), (384,), (w, cp.int64(nbytes // 16), out)))
        for name in ("mmaq", "dp4a2", "immaq", "immai"):
            fn = mod.get_function(name)
            timeit(nt, name, lambda fn=fn: fn((132,), (384,), (w, cp.int32(rows), out)))


def device_name() -> str:
    return cp.cuda.runtime.getDeviceProperties(0)["name"].decode()


if __name__ == "__main__":
    main()
